# source: NVIDIA DeepLearningExamples PyTorch/LanguageModeling/BERT run_pretraining.py take_optimizer_step with --allreduce_post_accumulation: flat fp32 buffer, apex_C.unflatten, amp_C.multi_tensor_scale through multi_tensor_applier with an overflow buffer, dist.all_reduce, scaler._overflow_buf + scaler.update_scale(), _amp_state.opt_properties.master_weights and optimizer._amp_stash on overflow
# library: apex.amp, apex.optimizers, apex.multi_tensor_apply (amp_C, apex_C)
# group: amp
# device: written device-agnostic (device = "cuda" if available else "cpu") where run_pretraining.py allocates flat_raw on 'cuda'; a gloo world of 1
"""DLE BERT's allreduce_post_accumulation step: the hand-written gradient all-reduce around apex's loss scaler."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn

# was: import amp_C
from overdrive.apex import amp_C
# was: import apex_C
from overdrive.apex import apex_C
# was: from apex import amp
from overdrive.apex import amp
# was: from apex.amp import _amp_state
from overdrive.apex.amp import _amp_state
# was: from apex.multi_tensor_apply import multi_tensor_applier
from overdrive.apex.multi_tensor_apply import multi_tensor_applier
# was: from apex.optimizers import FusedLAMB
from overdrive.apex.optimizers import FusedLAMB

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
gradient_accumulation_steps = 2
skipped_steps = 0


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def take_optimizer_step(optimizer, model, overflow_buf, global_step):
    global skipped_steps
    # manually allreduce gradients after all accumulation steps
    # 1. allocate an uninitialized buffer for flattened gradient
    loss_scale = _amp_state.loss_scalers[0].loss_scale()
    master_grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
    flat_grad_size = sum(p.numel() for p in master_grads)
    flat_raw = torch.empty(flat_grad_size, device=device, dtype=torch.float32)
    # 2. combine unflattening and predivision of unscaled 'raw' gradient
    allreduced_views = apex_C.unflatten(flat_raw, master_grads)
    overflow_buf.zero_()
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [master_grads, allreduced_views],
                         loss_scale / (get_world_size() * gradient_accumulation_steps))
    # 3. sum gradient across ranks. Because of the predivision, this averages the gradient
    dist.all_reduce(flat_raw)
    # 4. combine unscaling and unflattening of allreduced gradient
    overflow_buf.zero_()
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [allreduced_views, master_grads], 1. / loss_scale)
    # 5. update loss scale
    scaler = _amp_state.loss_scalers[0]
    old_overflow_buf = scaler._overflow_buf
    scaler._overflow_buf = overflow_buf
    had_overflow = scaler.update_scale()
    scaler._overflow_buf = old_overflow_buf
    # 6. call optimizer step function
    if had_overflow == 0:
        optimizer.step()
        global_step += 1
    else:
        skipped_steps += 1
        if _amp_state.opt_properties.master_weights:
            for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                param.grad = None
    for param in model.parameters():
        param.grad = None
    return global_step


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8)).to(device)
        optimizer = FusedLAMB(model.parameters(), lr=1e-2)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic")
        overflow_buf = torch.zeros(1, dtype=torch.int, device=device)
        g = torch.Generator().manual_seed(1)
        w = torch.randn(16, 8, generator=g)
        global_step, losses = 0, []
        for step in range(16):
            x = torch.randn(32, 16, generator=g).to(device)
            loss = nn.functional.mse_loss(model(x).float(), (x @ w).to(device))
            with amp.scale_loss(loss, optimizer, delay_overflow_check=True) as scaled_loss:
                scaled_loss.backward()
            losses.append(loss.item())
            if (step + 1) % gradient_accumulation_steps == 0:
                global_step = take_optimizer_step(optimizer, model, overflow_buf, global_step)
        assert global_step == 8 and skipped_steps == 0
        assert losses[-1] < 0.75 * losses[0], losses  # LAMB moves each weight ~lr of its norm a step: 8 steps
    finally:
        dist.destroy_process_group()
