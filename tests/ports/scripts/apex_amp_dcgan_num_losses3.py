# source: apex examples/dcgan/main_amp.py: [netD, netG], [optimizerD, optimizerG] = amp.initialize(..., opt_level=opt.opt_level, num_losses=3); errD_real / errD_fake / errG each under scale_loss with loss_id 0 / 1 / 2; BCEWithLogitsLoss; torch.save(netG.state_dict()) per epoch
# library: apex.amp
# group: amp
# device: as the example, device = torch.device("cuda:0" if opt.cuda else "cpu") with opt.cuda = torch.cuda.is_available()
"""A DCGAN at toy size in the shape of apex's amp DCGAN example (torchvision's save_image left out)."""
import argparse
import os

import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data

# was: from apex import amp
from overdrive.apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--batchSize", type=int, default=16)
parser.add_argument("--nz", type=int, default=8)
parser.add_argument("--ngf", type=int, default=8)
parser.add_argument("--ndf", type=int, default=8)
parser.add_argument("--niter", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.0002 * 10)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--outf", default=".")
parser.add_argument("--manualSeed", type=int, default=999)
parser.add_argument("--opt_level", default="O1", help='amp opt_level, default="O1"')
opt = parser.parse_args([])
opt.cuda = torch.cuda.is_available()
torch.manual_seed(opt.manualSeed)
device = torch.device("cuda:0" if opt.cuda else "cpu")
nz, ngf, ndf, nc = opt.nz, opt.ngf, opt.ndf, 1


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        m.weight.data.normal_(0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        m.weight.data.normal_(1.0, 0.02)
        m.bias.data.fill_(0)


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, 1, 4, 1, 0, bias=False))  # no Sigmoid: BCEWithLogitsLoss, as the amp example

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


# "real" images: a bright diagonal on a dark background, with noise
g = torch.Generator().manual_seed(0)
real = -torch.ones(128, nc, 8, 8)
real[:, :, torch.arange(8), torch.arange(8)] = 1.0
real = (real + 0.1 * torch.randn(real.shape, generator=g)).clamp(-1, 1)
dataloader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(real), batch_size=opt.batchSize, shuffle=False)


def run(opt_level):
    torch.manual_seed(opt.manualSeed)
    netG = Generator().to(device)
    netG.apply(weights_init)
    netD = Discriminator().to(device)
    netD.apply(weights_init)
    criterion = nn.BCEWithLogitsLoss()
    real_label = 1
    fake_label = 0
    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    [netD, netG], [optimizerD, optimizerG] = amp.initialize(
        [netD, netG], [optimizerD, optimizerG], opt_level=opt_level, num_losses=3)
    log = []
    for epoch in range(opt.niter):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real_cpu = data[0].to(device)
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=torch.float, device=device)
            output = netD(real_cpu)
            errD_real = criterion(output, label)
            with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
                errD_real_scaled.backward()
            D_x = torch.sigmoid(output.float()).mean().item()

            noise = torch.randn(batch_size, nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
                errD_fake_scaled.backward()
            D_G_z1 = torch.sigmoid(output.float()).mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
                errG_scaled.backward()
            D_G_z2 = torch.sigmoid(output.float()).mean().item()
            optimizerG.step()
            print("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"
                  % (epoch, opt.niter, i, len(dataloader), errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))
            log.append((errD.item(), errG.item(), D_x, D_G_z1))
        torch.save(netG.state_dict(), "%s/netG_epoch_%d.pth" % (opt.outf, epoch))
    return netG, log


if __name__ == "__main__":
    netG, log = run(opt.opt_level)
    assert len(amp._amp_state.loss_scalers) == 3  # one loss scaler per loss_id
    assert all(torch.isfinite(torch.tensor(row)).all() for row in log)
    assert all(p.dtype == torch.float32 for p in netG.parameters())  # O1 keeps fp32 weights
    # the discriminator learns to tell the diagonal from the generator's samples
    assert log[-1][2] > log[-1][3] + 0.05 and log[-1][0] < log[0][0], log[-1]
    # the saved generator reloads into a plain fp32 model: the same weights (tolerance 0), and its fp32 images
    # match the O1 model's half-precision ones to bf16 rounding (atol 3e-2 on tanh outputs)
    fresh = Generator().to(device)
    fresh.load_state_dict(torch.load(os.path.join(opt.outf, "netG_epoch_%d.pth" % (opt.niter - 1))))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), netG.state_dict().values()))
    z = torch.randn(4, nz, 1, 1, device=device)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(z), netG.eval()(z).float(), rtol=0, atol=3e-2)
    # the same run in fp32 (O0) for the first steps: half-precision rounding only (rtol 5e-2)
    _, ref = run("O0")
    torch.testing.assert_close(torch.tensor(log[:3]), torch.tensor(ref[:3]), rtol=5e-2, atol=1e-2)
