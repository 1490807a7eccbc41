"""What the current window has seen: which params got a gradient, how many
micro-steps and items, the inf/NaN flags, a pending clip coefficient; and how
the window's sum is normalized.

The window's gradient of a param is ``grad_scale * buffer`` with::

    grad_scale = c * A / D
    c = min(1, max_norm / (norm + 1e-6)) if clipping, else 1
    A = the divisor the buffers already carry (W when a data-parallel
        reduction averaged them over W ranks, else 1)
    D = the micro-steps of the window (normalize="mean"), 1 ("sum") or the
        window's total of step(num_items=...) ("items"), over every rank
"""

from __future__ import annotations

import math
import numbers

import torch

NORMALIZE = ("mean", "sum", "items")


def run_seed(seed: int | None, device: torch.device, group=None, world: int = 1) -> int:
    """The stochastic-rounding seed of a run: the one given, or one drawn from
    torch's CPU generator without advancing it (rank 0's in distributed runs:
    every rank that rounds the same elements must draw the same bits).

    Not advancing it keeps torch.optim's behaviour: constructing an optimizer
    leaves the caller's random stream (data order, dropout, later inits) where
    it was, so a run that swaps torch.optim.AdamW for ours sees the same
    random numbers. The seed still follows torch.manual_seed."""
    if seed is None:
        with torch.random.fork_rng(devices=[]):
            seed = int(torch.randint(0, 2**32, (), dtype=torch.int64, device="cpu"))
        if world > 1:
            import torch.distributed as dist

            shared = torch.tensor([seed], dtype=torch.int64, device=device)
            dist.broadcast(shared, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
            seed = int(shared.item())
    return seed


class Window:
    """The state of the current window. Everything that changes during training
    lives here (not on the wrapper), so a proxy object that copies the
    wrapper's attributes (Lightning's LightningOptimizer) shares it."""

    def __init__(self, normalize: str, device: torch.device, seed: int) -> None:
        self.normalize = normalize
        self.device = device
        self.seed = seed  # stochastic rounding: fixed for the run, mixed with the window count
        self.windows = 0  # windows ended so far
        self.stepped = False  # the last step() call ended a window
        self.last_grad_norm: torch.Tensor | None = None
        # Set at every forward of a DDP module the wrapper took over: whether the
        # framework meant this micro-step to sync (the window's last); None: no DDP.
        self.sync_intent: bool | None = None
        self.found_inf = torch.zeros(1, device=device)  # any inf/NaN in the window so far
        self.step_found_inf = torch.zeros(1, device=device)  # ... in the current micro-step
        # torch.optim steps every param whose .grad is a tensor, zeros included:
        # after zero_grad(set_to_none=False) the params that had a gradient keep a
        # zero one (and are stepped: momentum, weight decay) until zero_grad()
        # sets them to None.
        self.had_grad: set[int] = set()  # params with a gradient since the last zero_grad(set_to_none=True)
        self.zero_grads: set[int] = set()  # params whose .grad plain PyTorch would hold as zeros
        # Params the last window's step updated with a gradient that nothing has
        # cleared since (no zero_grad(); .grad neither dropped nor replaced):
        # plain PyTorch's .grad would still hold it, and its next step() would
        # use it again. Kept where step() is torch.optim's (accum_steps=None).
        self.unzeroed: set[int] = set()
        self.clear()

    def clear(self) -> None:
        self.touched: set[int] = set()  # indices of the params with a gradient in this window
        self.micro_steps = 0  # completed step() calls in this window
        self.grads_since_step = False  # a gradient arrived since the last step() call
        self.items: float | torch.Tensor = 0.0
        self.found_inf.zero_()
        self.clip_coef: torch.Tensor | None = None
        self.divisor = 1.0  # A above: set when a reduction averages the buffers over ranks

    def stepped_params(self) -> set[int]:
        """The params the window's step updates: those with a gradient, and
        those whose gradient zero_grad(set_to_none=False) kept as zeros."""
        return self.touched | self.zero_grads

    def zero_grad(self, set_to_none: bool) -> None:
        """Record a zero_grad() call, in torch.optim's meaning."""
        self.unzeroed.clear()
        if set_to_none:
            self.had_grad.clear()
            self.zero_grads.clear()
        else:
            self.zero_grads = self.had_grad | self.touched | self.zero_grads

    def forget_grad(self, index: int) -> None:
        """Param ``index``'s ``.grad`` was found None with no gradient in the
        window (``p.grad = None``): torch.optim skips it, even after a
        ``zero_grad(set_to_none=False)``, until a gradient arrives."""
        self.had_grad.discard(index)
        self.zero_grads.discard(index)

    def renumber(self, indices: dict[int, int]) -> None:
        """The params were laid out anew between windows: ``indices`` maps each
        old index still held to its new one; the params no longer held are forgotten."""
        self.had_grad = {indices[i] for i in self.had_grad if i in indices}
        self.zero_grads = {indices[i] for i in self.zero_grads if i in indices}
        self.unzeroed = {indices[i] for i in self.unzeroed if i in indices}

    def window_seed(self) -> int:
        """The stochastic rounding seed of the current window: a new one every
        window, a function of the run's seed."""
        return (self.seed * 0x9E3779B1 + self.windows * 0x85EBCA77 + 0x165667B1) % 2**32

    def count_items(self, num_items, ends_window: bool) -> None:
        if self.normalize != "items":
            if num_items is not None:
                raise ValueError(f"num_items is only used with normalize='items' (this wrapper has {self.normalize!r})")
            return
        if num_items is None:
            raise ValueError("normalize='items' needs step(num_items=n) on every micro-step")
        # A micro-batch may count 0 items (no target tokens in it); the
        # window's total must be > 0, which normalization() checks.
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.dtype == torch.bool or num_items.is_complex():
                raise ValueError(
                    f"num_items must be a 1-element real tensor; got {num_items.numel()} elements of {num_items.dtype}"
                )
            items = num_items.reshape(()).to(self.device, torch.float32)
            # On the device, without a host sync (on the CPU it raises here).
            torch._assert_async(items >= 0, "num_items must be >= 0 (a count of items)")
            self.items = self.items + items
        else:
            if isinstance(num_items, bool) or not isinstance(num_items, numbers.Real) or not 0 <= num_items < math.inf:
                raise ValueError(
                    f"num_items must be a number >= 0 (this micro-batch's items) or a 1-element tensor; "
                    f"got {num_items!r}"
                )
            total = self.items + float(num_items)
            if ends_window and not isinstance(total, torch.Tensor) and total <= 0:
                raise ValueError(
                    f"num_items: the window ends with this step() and counted no items in all "
                    f"({self.micro_steps + 1} micro-steps): a window needs num_items > 0 in all"
                )
            self.items = total

    def normalization(self, pending: bool = False):
        """A / D of the module docstring for this rank's window so far (``pending``:
        count the micro-step in progress, whose gradients arrived but whose
        step() has not: the intake's micro_step_has_gradients(); under "items"
        refused there, its items not counted yet)."""
        if self.normalize == "sum":
            return self.divisor
        if self.normalize == "mean":
            return self.divisor / max(1, self.micro_steps + (1 if pending else 0))
        if pending:
            # The micro-step's items come with its step(num_items=...): the
            # window's divisor is not known yet (the items so far would give a
            # larger gradient than any step uses: a clip too strong, silently).
            raise RuntimeError(
                "normalize='items': this micro-step's gradients arrived, but its items come with its "
                "step(num_items=...), so the window's gradient (its sum divided by all its items) is not known yet. "
                "Clip with max_grad_norm=, which clips at the window's step once its items are counted "
                "(opt.last_grad_norm holds the norm it clipped), or read the window between micro-steps (after a "
                "step(), before the next backward)"
            )
        if isinstance(self.items, torch.Tensor):
            return self.divisor / self.items
        if self.items <= 0:
            raise RuntimeError("normalize='items': no items were counted in this window yet")
        return self.divisor / self.items

    def global_normalization(self, items, micro_steps):
        """A / D over every rank's window, from the ``items`` and ``micro_steps``
        summed across ranks."""
        total = {"sum": None, "mean": micro_steps, "items": items}[self.normalize]
        return self.divisor if total is None else (self.divisor / total).to(torch.float32)

    def end_micro_step(self, check_inf: bool) -> torch.Tensor | None:
        """Count a micro-step; returns its inf/NaN flag (when checked)."""
        self.micro_steps += 1
        self.grads_since_step = False
        if not check_inf:
            return None
        flag = self.step_found_inf
        torch.maximum(self.found_inf, flag, out=self.found_inf)
        self.step_found_inf = torch.zeros(1, device=self.device)
        return flag

    def combine_clip(self, coef: torch.Tensor) -> None:
        self.clip_coef = coef if self.clip_coef is None else torch.minimum(coef, self.clip_coef)

    # ---- checkpoints --------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "touched": sorted(self.touched),
            "micro_steps": self.micro_steps,
            "items": self.items.clone() if isinstance(self.items, torch.Tensor) else self.items,
            "window_found_inf": self.found_inf.clone(),
            "step_found_inf": self.step_found_inf.clone(),
            "clip_coef": None if self.clip_coef is None else self.clip_coef.clone(),
            "windows": self.windows,
            "seed": self.seed,
            "divisor": self.divisor,
            "normalize": self.normalize,
            "had_grad": sorted(self.had_grad),
            "zero_grads": sorted(self.zero_grads),
            "unzeroed": sorted(self.unzeroed),
            "grads_since_step": self.grads_since_step,
        }

    def check_state_dict(self, saved: dict, param_count: int) -> None:
        """Raises if ``saved`` cannot be loaded; loads nothing."""
        indices = [
            *saved["touched"],
            *saved.get("had_grad", ()),
            *saved.get("zero_grads", ()),
            *saved.get("unzeroed", ()),
        ]
        arrivals = saved.get("arrivals", ())
        counts = [a[1] if isinstance(a, (list, tuple)) and len(a) == 2 else None for a in arrivals]
        if not all(isinstance(c, int) and c >= 0 for c in counts):
            raise ValueError(
                f"checkpoint window entry 'arrivals' must be [param index, count >= 0] pairs; got {list(arrivals)[:5]}"
            )
        indices += [a[0] for a in arrivals]
        bad = [i for i in indices if not (isinstance(i, int) and 0 <= i < param_count)]
        if bad:
            raise ValueError(f"checkpoint window names params {bad[:5]} of {param_count}; it is of another model")
        for key in ("window_found_inf", "step_found_inf"):
            if saved[key].numel() != 1:
                raise ValueError(f"checkpoint window entry {key!r} must have 1 element; got {saved[key].numel()}")
        if not (isinstance(saved["micro_steps"], int) and saved["micro_steps"] >= 0):
            raise ValueError(f"checkpoint window has micro_steps={saved['micro_steps']!r}")

    def load_run(self, saved: dict) -> None:
        """Of a checkpoint saved at a window boundary, what is the run's, not
        the window's: the windows ended so far and the seed (the stochastic
        rounding stream goes on from them)."""
        self.windows = saved.get("windows", 0)
        self.seed = saved.get("seed", self.seed)

    def load_state_dict(self, saved: dict) -> None:
        self.touched = set(saved["touched"])
        self.micro_steps = saved["micro_steps"]
        items = saved["items"]
        self.items = items.to(self.device) if isinstance(items, torch.Tensor) else items
        self.found_inf.copy_(saved["window_found_inf"])
        self.step_found_inf.copy_(saved["step_found_inf"])
        self.clip_coef = None if saved["clip_coef"] is None else saved["clip_coef"].to(self.device)
        self.windows = saved.get("windows", 0)
        self.seed = saved.get("seed", self.seed)
        self.divisor = saved.get("divisor", 1.0)
        self.had_grad = set(saved.get("had_grad", ()))
        self.zero_grads = set(saved.get("zero_grads", ()))
        # (unzeroed stays: loading an optimizer's state clears no .grad in torch.optim,
        # so a step() with the last step's gradients uncleared is still refused)
        # Saved between a backward and its step(), the window's gradients are still
        # the current micro-step's: a zero_grad() discards them (intake "grad") or is
        # refused ("hooks"), as before the save. (Checkpoints without the entry:
        # with no completed micro-step, any gradient of the window arrived since the last step().)
        self.grads_since_step = bool(saved.get("grads_since_step", self.micro_steps == 0 and self.touched))
