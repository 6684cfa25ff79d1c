"""Session actions on the laid-out model: verify against one process, checkpoints, export.

Owns the client side of verify() (the report and its table), save()/load() (absolute
paths, a small manifest that names the model, checked before any rank is touched) and
export_script(). A mixin of Session: it uses the Session's rank calls and its spec/plan,
and knows nothing of pools or widgets.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from ..runtime import api
from ._sync import run_sync
from .errors import SessionError

MANIFEST = "interactive_parallel.json"


@dataclass
class VerifyReport:
    """The current plan against a single-process reference on the same weights and batch."""

    ok: bool
    """True when |dloss| and every parameter's max |dgrad| are within `tolerance`."""
    tolerance: dict[str, float]
    loss_ref: float
    loss_par: float
    dloss: float
    max_grad_diff: float
    params: list[dict[str, Any]] = field(default_factory=list)
    """Per parameter: name, shape, max_abs_diff of the gradient (gathered to full tensors)."""
    plan: str = ""

    @classmethod
    def from_dict(cls, d: dict[str, Any], plan: str = "") -> "VerifyReport":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names}, plan=plan)

    def __getitem__(self, key: str) -> Any:  # report["ok"] as well as report.ok
        return getattr(self, key)

    def worst(self, n: int = 5) -> list[dict[str, Any]]:
        return sorted(self.params, key=lambda p: -p["max_abs_diff"])[:n]

    def __str__(self) -> str:
        head = (f"verify {self.plan or ''}: {'OK' if self.ok else 'MISMATCH'}  "
                f"loss par {self.loss_par:.6f} ref {self.loss_ref:.6f} |dloss| {self.dloss:.2e} "
                f"(tol {self.tolerance.get('loss', 0):.0e}); max |dgrad| {self.max_grad_diff:.2e} "
                f"(tol {self.tolerance.get('grad', 0):.0e})")
        width = max((len(p["name"]) for p in self.params), default=4)
        rows = [f"  {p['name']:<{width}}  {str(tuple(p.get('shape', ()))):>14}  {p['max_abs_diff']:.2e}"
                for p in self.params]
        return "\n".join([head, f"  {'parameter':<{width}}  {'shape':>14}  max |dgrad|", *rows])

    def _repr_pretty_(self, p, cycle):
        p.text(str(self))


class ModelOps:
    """verify / save / load / export_script for Session."""

    def _laid_out(self):
        if self.spec is None or self.plan is None:
            raise SessionError("no model laid out: call load_model(...) and apply(Plan(...)) first")
        return self._require()

    async def verify_async(self) -> VerifyReport:
        caller = self._laid_out()
        out = await self._wait_async(caller.submit(api.verify), "verify")
        return VerifyReport.from_dict(out[0], plan=self.plan.describe())

    def verify(self) -> VerifyReport:
        """Loss and per-parameter gradient differences against one process holding the whole
        model, on the current weights and the current step's batch (no optimizer step)."""
        return run_sync(self.verify_async())

    async def save_async(self, path: str) -> str:
        caller = self._laid_out()
        path = os.path.abspath(path)  # the ranks' working directory is not ours
        os.makedirs(path, exist_ok=True)
        info = await self._wait_async(caller.submit(api.save_checkpoint, (path,)), "save")
        manifest = {"model": dataclasses.asdict(self.spec), "plan": self.plan.to_dict(),
                    "tensors": info[0].get("tensors")}
        with open(os.path.join(path, MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
        return path

    def save(self, path: str) -> str:
        """Write the model (each rank its own shards) with torch.distributed.checkpoint."""
        return run_sync(self.save_async(path))

    async def load_async(self, path: str) -> str:
        path = os.path.abspath(path)
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise FileNotFoundError(f"{path} holds no checkpoint of this package ({MANIFEST} missing)")
        with open(manifest_path) as f:
            saved = json.load(f)["model"]
        if self.spec is not None and saved.get("config") != self.spec.config:
            raise SessionError(f"checkpoint {path} is of model {saved.get('name')!r}, not the loaded "
                               f"{self.spec.name!r}: load_model the same model first")
        caller = self._laid_out()
        await self._wait_async(caller.submit(api.load_checkpoint, (path,)), "load")
        return path

    def load(self, path: str) -> str:
        """Load weights saved under any plan into the current layout (resharded on load);
        the optimizer starts fresh."""
        return run_sync(self.load_async(path))

    def export_script(self, path: str, steps: int = 10) -> str:
        """Write a standalone `torchrun --nproc_per_node N` script that rebuilds this model,
        plan and training settings from interactive_parallel.runtime (no ipyparallel)."""
        from ..runtime.export import script_text

        if self.spec is None or self.plan is None:
            raise SessionError("no model laid out: call load_model(...) and apply(Plan(...)) first")
        text = script_text(self.spec, self.plan, steps, timeout_s=self.collective_timeout)
        path = os.path.abspath(path)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
        return path
