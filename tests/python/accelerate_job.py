"""An ordinary Hugging Face Accelerate script, nothing meshd-specific in it
(tests/lab_frameworks.rs): `Accelerator()` finds the job from the environment, prepares a
small model, optimizer and data loader (split across the ranks), trains, and each rank
prints what Accelerate chose (distributed type, process index, processes) and a SHA-256 of
its final weights, which must be the same on every rank.
"""
import ctypes
import hashlib

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.set_num_threads(1)
    accelerator = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(384, 16, generator=g)
    loader = DataLoader(TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True)), batch_size=16, shuffle=True)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    steps = 0
    for _ in range(2):
        for xb, yb in loader:
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.mse_loss(model(xb), yb))
            opt.step()
            steps += 1
    accelerator.wait_for_everyone()
    flat = torch.cat([p.detach().reshape(-1) for p in accelerator.unwrap_model(model).parameters()])
    digest = hashlib.sha256(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())).hexdigest()
    print(
        f"ACCELERATE rank={accelerator.process_index} local={accelerator.local_process_index} "
        f"world={accelerator.num_processes} type={accelerator.distributed_type} steps={steps} params_sha256={digest}",
        flush=True,
    )


if __name__ == "__main__":
    main()
