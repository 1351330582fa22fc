# source: Megatron-LM megatron/optimizer/clip_grads.py clip_grad_norm_fp32 and count_zeros: amp_C.multi_tensor_l2norm through multi_tensor_applier with a dummy overflow buffer, total_norm ** norm_type all-reduced over the model-parallel group, clip_coeff = max_norm / (total_norm + 1.0e-6), amp_C.multi_tensor_scale on the grads in place
# library: apex.multi_tensor_apply (amp_C)
# group: amp
# count: extra
# device: written device-agnostic where Megatron allocates the overflow buffer on torch.cuda.current_device(); a gloo world of 1
"""Megatron-LM's gradient clipping with apex's fused multi-tensor L2 norm and scale."""
import os

import torch
import torch.distributed as dist

# was: import amp_C
from overdrive.apex import amp_C
# was: from apex.multi_tensor_apply import multi_tensor_applier
from overdrive.apex.multi_tensor_apply import multi_tensor_applier

device = "cuda" if torch.cuda.is_available() else "cpu"


def clip_grad_norm_fp32(parameters, max_norm, norm_type=2, model_parallel_group=None):
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    grads_for_norm = []
    for param in parameters:
        if param.grad is not None:
            grad = param.grad.detach()
            grads.append(grad)
            grads_for_norm.append(grad)
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    total_norm = 0.0
    if norm_type == float("inf"):
        total_norm = max(grad.abs().max() for grad in grads_for_norm)
        total_norm_cuda = torch.tensor([float(total_norm)], dtype=torch.float, device=device)
        dist.all_reduce(total_norm_cuda, op=dist.ReduceOp.MAX, group=model_parallel_group)
        total_norm = total_norm_cuda[0].item()
    else:
        if norm_type == 2.0:
            dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device=device)
            # Use apex's multi-tensor applier for efficiency reasons.
            # Multi-tensor applier takes a function and a list of list
            # and performs the operation on that list all in one kernel.
            if grads_for_norm:
                grad_norm, _ = multi_tensor_applier(
                    amp_C.multi_tensor_l2norm, dummy_overflow_buf, [grads_for_norm], False  # no per-parameter norm
                )
            else:
                grad_norm = torch.tensor([0], dtype=torch.float, device=device)
            # Since we will be summing across data parallel groups,
            # we need the pow(norm-type).
            total_norm = grad_norm ** norm_type
        else:
            for grad in grads_for_norm:
                grad_norm = torch.norm(grad, norm_type)
                total_norm += grad_norm ** norm_type
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=model_parallel_group)
        total_norm = total_norm.item() ** (1.0 / norm_type)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device=device)
        multi_tensor_applier(amp_C.multi_tensor_scale, dummy_overflow_buf, [grads, grads], clip_coeff)
    return total_norm


def count_zeros_fp32(parameters):
    total_num_zeros = torch.tensor([0.0], dtype=torch.float, device=device)
    for param in parameters:
        if param.grad is not None:
            total_num_zeros = total_num_zeros + param.grad.numel() - torch.count_nonzero(param.grad)
    dist.all_reduce(total_num_zeros, op=dist.ReduceOp.SUM)
    return total_num_zeros.item()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(device)
        reference = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(16, 32, device=device)
        (model(x).square().sum() * 100).backward()
        expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        clipped_ref = [p.grad.detach().clone() * (1.0 / (expected + 1.0e-6)) for p in model.parameters()]
        norm = clip_grad_norm_fp32(model.parameters(), max_norm=1.0)
        assert abs(norm - expected) <= 1e-5 * expected, (norm, expected)
        for p, want in zip(model.parameters(), clipped_ref):
            torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-8)
        assert abs(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item() - 1.0) < 1e-4
        assert count_zeros_fp32(model.parameters()) == 0
        inf_norm = clip_grad_norm_fp32(model.parameters(), max_norm=10.0, norm_type=float("inf"))
        assert inf_norm == max(p.grad.abs().max().item() for p in model.parameters())
        optimizer.step()
        assert all(not torch.equal(a, b) for a, b in zip(reference, model.parameters()))
    finally:
        dist.destroy_process_group()
