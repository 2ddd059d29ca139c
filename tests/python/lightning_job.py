"""An ordinary PyTorch Lightning DDP script, nothing meshd-specific in it (tests/lab_frameworks.rs):
`Trainer(strategy="ddp", accelerator="cpu", devices=2, num_nodes=3)` trains a small model on
data that Lightning's DistributedSampler splits across the ranks, then each rank prints what
Lightning chose (world size, ranks, cluster environment) and a SHA-256 of its final weights,
which must be the same on every rank. Where SLURM variables are present, it also prints
what Lightning's SLURMEnvironment would read from them (a script that passes that plugin).
"""
import ctypes
import hashlib
import os

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main():
    torch.set_num_threads(1)
    pl.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(384, 16, generator=g)
    data = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True))
    model = Regressor()
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        num_nodes=3,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=16))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())).hexdigest()
    env = type(trainer.strategy.cluster_environment).__name__
    slurm = ""
    if "SLURM_NTASKS" in os.environ:
        from lightning_fabric.plugins.environments import SLURMEnvironment

        s = SLURMEnvironment()
        slurm = f" slurm_world={s.world_size()} slurm_rank={s.global_rank()} slurm_local={s.local_rank()} slurm_node={s.node_rank()}"
    print(
        f"LIGHTNING rank={trainer.global_rank} local={trainer.local_rank} node={trainer.node_rank} "
        f"world={trainer.world_size} env={env} steps={trainer.global_step} params_sha256={digest}{slurm}",
        flush=True,
    )


if __name__ == "__main__":
    main()
