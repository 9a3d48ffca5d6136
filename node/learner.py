"""The learner: a plain synchronous training loop step on the device. It never touches the network.

It owns the local model θ, the AdamW inner optimizer and the data position. Between steps the daemon may
replace θ with a merged replica (``load_flat``) or read it out (``flat_params``) for a pseudo-gradient.
"""

from __future__ import annotations

import math

import torch

from atoll.models.configs import get_model_config
from atoll.models.data import Corpus
from atoll.models.gpt import GPT
from atoll.models.outer import flatten_params, unflatten_into

from .config import RunConfig
from .device import Device


class Learner:
    def __init__(self, run: RunConfig, device: Device, corpus: Corpus, shard: int, batch_size: int) -> None:
        self.run, self.device, self.corpus, self.shard, self.batch_size = run, device, corpus, shard, batch_size
        self.model_cfg = get_model_config(run.model)
        torch.manual_seed(run.seed)
        self.model = GPT(self.model_cfg).to(device.torch_device)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=run.inner_lr, betas=(0.9, 0.95),
                                           weight_decay=run.weight_decay)
        self.position = 0  # data windows consumed in this daemon's shard
        self.step = 0
        self.tokens = 0

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model_cfg.seq_len

    def _lr(self) -> float:
        warm = self.run.warmup_steps
        return self.run.inner_lr * min(1.0, (self.step + 1) / warm) if warm else self.run.inner_lr

    def train_step(self) -> float:
        """One AdamW step on the next batch of this daemon's shard; returns the training loss."""
        batch = self.corpus.batch_at(self.shard, self.position, self.batch_size).to(self.device.torch_device)
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()
        loss = self.model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.device.sync()
        self.position += self.batch_size
        self.step += 1
        self.tokens += self.tokens_per_step
        return float(loss.detach())

    def flat_params(self) -> torch.Tensor:
        return flatten_params(self.params)

    def load_flat(self, flat: torch.Tensor) -> None:
        unflatten_into(flat, self.params)
        self.device.sync()

    @torch.no_grad()
    def evaluate(self, batches: list[torch.Tensor]) -> float:
        """Mean loss of the current θ on fixed held-out batches."""
        self.model.eval()
        losses = [float(self.model(b[:, :-1].to(self.device.torch_device), b[:, 1:].to(self.device.torch_device)))
                  for b in batches]
        self.model.train()
        return sum(losses) / len(losses) if losses else math.nan

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """θ and the inner optimizer state as named CPU tensors (for checkpoints)."""
        out = {f"model.{i}": p.detach().cpu() for i, p in enumerate(self.params)}
        for i, p in enumerate(self.params):
            for k, v in self.optimizer.state.get(p, {}).items():
                out[f"opt.{i}.{k}"] = torch.as_tensor(v).detach().cpu()
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for i, p in enumerate(self.params):
                p.copy_(tensors[f"model.{i}"].to(p.device, p.dtype))
        state = {}
        for i, p in enumerate(self.params):
            entry = {k.split(".", 2)[2]: v for k, v in tensors.items() if k.startswith(f"opt.{i}.")}
            if entry:
                state[i] = {k: v.to(p.device) if k != "step" else v for k, v in entry.items()}
        sd = self.optimizer.state_dict()
        sd["state"] = state
        self.optimizer.load_state_dict(sd)
        self.device.sync()
