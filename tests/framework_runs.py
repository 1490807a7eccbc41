"""Training runs through the real frameworks, plain optimizer against
AccumulatingOptimizer, for tests/test_frameworks.py. Each run is a process of
its own (frameworks keep process-wide state: Accelerate's AcceleratorState,
the transformers version on sys.path, torch.distributed): ``python
tests/framework_runs.py <name> [json options]`` prints one JSON line.

Every model is tiny, built from a config with random weights (no downloads);
clipping is on and active (the plain runs' norms exceed the clip), the LR
scheduler is built on the optimizer the framework receives.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

import torch
from torch.nn import functional as F

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import accumkernels as ak  # noqa: E402

CLIP = 0.05
# Adam turns a near-zero gradient element into a step of up to lr: with eps=1e-8
# the last-ulp differences between two correct AdamW implementations (torch's
# fused kernel contracts a + b*c, ours does not) would move such elements by
# 1e-4 (see tests/test_optimizer.py). eps=1e-4 keeps them below the tolerance.
ADAM_EPS = 1e-4


def params_of(model) -> list[list[float]]:
    return [p.detach().double().flatten().tolist() for p in model.parameters() if p.requires_grad]


def state_kinds(opt) -> list[str]:
    """The optimizer's per-param state as sorted "key:dtype" strings, read from
    its state_dict (what a checkpoint holds)."""
    state = opt.state_dict()["state"]
    return sorted({f"{k}:{str(v.dtype).removeprefix('torch.')}" for s in state.values() for k, v in s.items()})


def make_optimizer(params, wrap: bool, **wrapper_options):
    inner = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return ak.AccumulatingOptimizer(inner, **wrapper_options) if wrap else inner


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 3))


def regression_data(n=64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 12, generator=g) * 5, torch.randn(n, 3, generator=g)


# ---- Hugging Face -----------------------------------------------------------------


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


class TokenData(torch.utils.data.Dataset):
    """Sequences of random tokens with padding at the end of some (label -100),
    so micro-batches hold different numbers of target tokens."""

    def __init__(self, n=32, length=16):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (n, length), generator=g)
        self.lengths = torch.randint(length // 2, length + 1, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[self.lengths[i] :] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def hf_trainer(wrap: bool, max_grad_norm: float, peft: bool = False, unfreeze: bool = False) -> dict:
    """``unfreeze``: the embedding starts frozen and a callback unfreezes it at
    the second optimizer step (staged fine-tuning); the optimizer holds it
    from the start."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    # TrainingArguments first: under torchrun it initializes torch.distributed,
    # which the wrapper must see when it is built.
    args = TrainingArguments(
        output_dir=os.environ.get("TMPDIR", "/tmp") + "/ak-hf",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=3,
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_drop_last=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )
    model = tiny_llama()
    if peft:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    callbacks = []
    if unfreeze:
        embedding = model.get_input_embeddings().weight
        embedding.requires_grad_(False)

        class Unfreeze(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == 1:
                    embedding.requires_grad_(True)

        callbacks.append(Unfreeze())
    trainable = [p for p in model.parameters() if p.requires_grad or unfreeze]
    opt = make_optimizer(trainable, wrap)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    trainer = Trainer(
        model=model, args=args, train_dataset=TokenData(), optimizers=(opt, scheduler), callbacks=callbacks
    )
    trainer.train()
    if unfreeze:
        assert embedding.requires_grad
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "params": params_of(model),
        "grad_norms": [h.get("grad_norm") for h in logs],
        "lrs": [h.get("learning_rate") for h in logs],
        "intake": getattr(opt, "intake", None),
    }


# ---- Accelerate ------------------------------------------------------------------


def accelerate_loop(wrap: bool, mixed_precision: str = "no") -> dict:
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True, mixed_precision=mixed_precision)
    model = mlp()
    opt = make_optimizer(model.parameters(), wrap)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    x, y = regression_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, opt, loader, scheduler = accelerator.prepare(model, opt, loader, scheduler)
    norms = []
    for xb, yb in loader:
        with accelerator.accumulate(model):
            accelerator.backward(F.mse_loss(model(xb).float(), yb))
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            scheduler.step()
            opt.zero_grad()
    return {
        "params": params_of(accelerator.unwrap_model(model)),
        "grad_norms": norms,
        "lrs": scheduler.get_last_lr(),
        "world": accelerator.num_processes,
    }


def accelerate_skipped_window(wrap: bool) -> dict:
    """What Accelerate does with a GradScaler (fp16 on a GPU), on the CPU: its
    optimizer wrapper notices a skipped step by whether the inner step() ran,
    and the LR scheduler is not stepped then."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # the process state AcceleratedOptimizer reads
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opt = AcceleratedOptimizer(make_optimizer(model.parameters(), wrap), device_placement=False, scaler=scaler)
    skipped = []
    x, y = regression_data(32)
    for window, (xw, yw) in enumerate(zip(x.chunk(2), y.chunk(2))):
        for m, (xb, yb) in enumerate(zip(xw.chunk(4), yw.chunk(4))):
            loss = F.mse_loss(model(xb), yb) / 4
            if window == 0 and m == 2:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        opt.step()
        opt.zero_grad()
        skipped.append(opt.step_was_skipped)
    return {"params": params_of(model), "skipped": skipped, "scale": scaler.get_scale()}


# ---- Lightning -------------------------------------------------------------------


def lightning_trainer(**options):
    """A Lightning Trainer on one CPU, quiet (no progress bar, logger, checkpoints or summary)."""
    import pytorch_lightning as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        **options,
    )


def lightning_straight_and_resumed(make_module, epochs: int, name: str, callbacks=list):
    """Lightning on the regression data (batches of 4, accumulate_grad_batches=4,
    gradient_clip_val=CLIP): ``epochs`` epochs straight, and ``epochs - 1``, a
    checkpoint, a new Trainer resuming from it for the last; the two modules
    (``callbacks()``: each Trainer's callbacks)."""
    x, y = regression_data(32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ak-{name}-{os.getpid()}.ckpt")

    def fit(n, ckpt=None):
        module = make_module()
        trainer = lightning_trainer(
            max_epochs=n, accumulate_grad_batches=4, gradient_clip_val=CLIP, callbacks=callbacks()
        )
        trainer.fit(module, loader, ckpt_path=ckpt)
        return module, trainer

    straight, _ = fit(epochs)
    _, trainer = fit(epochs - 1)
    trainer.save_checkpoint(path)
    resumed, _ = fit(epochs, ckpt=path)
    os.remove(path)
    return straight, resumed


def lightning(wrap: bool, precision: str, manual: bool = False) -> dict:
    import pytorch_lightning as pl
    from pytorch_lightning.utilities import grad_norm

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.automatic_optimization = not manual
            self.norms, self.logged = [], []

        def training_step(self, batch, i):
            x, y = batch
            loss = F.mse_loss(self.net(x).float(), y)
            if manual:  # the user's own accumulation and clipping through Lightning's optimizer proxy
                opt = self.optimizers()
                self.manual_backward(loss / 4)
                if (i + 1) % 4 == 0:
                    if wrap:
                        self.norms.append(float(opt.clip_grad_norm_(CLIP)))
                    else:
                        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), CLIP)))
                    opt.step()
                    opt.zero_grad()
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.logged.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), wrap)

    module = Module()
    x, y = regression_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    options = {} if manual else dict(accumulate_grad_batches=4, gradient_clip_val=CLIP)
    if precision == "16-mixed":
        # On the CPU Lightning turns precision="16-mixed" into bf16; the plugin
        # itself gives fp16 autocast with its own GradScaler, as on a GPU.
        from pytorch_lightning.plugins import MixedPrecision

        options["plugins"] = [MixedPrecision("16-mixed", "cpu")]
    else:
        options["precision"] = precision
    trainer = lightning_trainer(max_epochs=1, **options)
    trainer.fit(module, loader)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "params": params_of(module.net),
        "norms": module.norms,
        "logged_norms": module.logged,
        "scaler": type(scaler).__name__ if scaler is not None else None,
    }


# ---- a GradScaler the wrapper was not given, in the user's own loop ------------------


def own_loop_scaler(wrap: bool, loop: str) -> dict:
    """``scaler.step(opt); scaler.update()``, with one poisoned micro-batch in
    window 0: once per window ("docs-loop", accum_steps=None, as the PyTorch docs
    write accumulation) or after every micro-batch with the wrapper counting the
    window ("wrapper-counts", accum_steps=4; the plain run counts by hand)."""
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    opt = make_optimizer(model.parameters(), wrap, **({"accum_steps": 4} if loop == "wrapper-counts" else {}))
    x, y = regression_data(48)
    scales = []
    for window, (xw, yw) in enumerate(zip(x.chunk(3), y.chunk(3))):
        for m, (xb, yb) in enumerate(zip(xw.chunk(4), yw.chunk(4))):
            loss = F.mse_loss(model(xb), yb)
            if window == 0 and m == 1:
                loss = loss * float("inf")
            per_micro = loop == "wrapper-counts" and wrap
            scaler.scale(loss if per_micro else loss / 4).backward()
            if per_micro or m == 3:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        scales.append(scaler.get_scale())
    return {"params": params_of(model), "scales": scales}


# ---- the drop-in class, built by the framework --------------------------------------


def hf_trainer_class(wrap: bool, state_dtype: str | None = None) -> dict:
    """Trainer builds the optimizer itself (its own param groups: no weight decay
    on biases and norms), its scheduler (cosine with warm-up), clips, trains in
    bf16, saves a checkpoint at step 2; a second Trainer resumes from it. Plain:
    Trainer's default AdamW; ours: optimizer_cls_and_kwargs=(accumkernels.AdamW,
    the same lr, betas and eps). ``state_dtype="8bit"``: ours holds 8-bit
    moments, and both runs train a model of bf16 params (a bitsandbytes
    user's setting)."""
    import shutil

    from transformers import Trainer, TrainingArguments

    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ak-hf-class-{wrap:d}-{os.getpid()}")
    shutil.rmtree(folder, ignore_errors=True)

    def trainer():
        args = TrainingArguments(
            output_dir=folder,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=4,
            max_steps=4,
            learning_rate=5e-3,
            weight_decay=0.1,
            lr_scheduler_type="cosine",
            warmup_steps=2,
            max_grad_norm=CLIP,
            bf16=True,
            logging_steps=1,
            report_to="none",
            use_cpu=True,
            save_strategy="steps",
            save_steps=2,
            seed=0,
            dataloader_drop_last=True,
            adam_epsilon=ADAM_EPS,
        )
        kwargs = {}
        if wrap:
            options = {"lr": args.learning_rate, "eps": args.adam_epsilon, "betas": (args.adam_beta1, args.adam_beta2)}
            if state_dtype is not None:
                options["state_dtype"] = state_dtype
            kwargs["optimizer_cls_and_kwargs"] = (ak.AdamW, options)
        model = tiny_llama() if state_dtype is None else tiny_llama().bfloat16()
        return Trainer(model=model, args=args, train_dataset=TokenData(), **kwargs)

    straight = trainer()
    straight.train()
    logs = [h for h in straight.state.log_history if "loss" in h]
    resumed = trainer()
    resumed.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-2"))
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "params": params_of(straight.model),
        "resumed": params_of(resumed.model),
        "grad_norms": [h.get("grad_norm") for h in logs],
        "lrs": [h.get("learning_rate") for h in logs],
        "weight_decays": sorted(g["weight_decay"] for g in straight.optimizer.param_groups),
        "class": type(getattr(straight.optimizer, "optimizer", straight.optimizer)).__name__,
        "state": state_kinds(straight.optimizer),
    }


def lightning_class(wrap: bool, state_dtype: str | None = None) -> dict:
    """configure_optimizers returns the class with a scheduler dict (stepped per
    optimizer step); 2 epochs straight, and 1 epoch, a checkpoint, a new
    Trainer resuming from it for the second. ``state_dtype``: ours's."""
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.logged = []

        def training_step(self, batch, i):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def on_before_optimizer_step(self, optimizer):
            from pytorch_lightning.utilities import grad_norm

            self.logged.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))

        def configure_optimizers(self):
            options = {} if state_dtype is None or not wrap else {"state_dtype": state_dtype}
            cls = ak.AdamW if wrap else torch.optim.AdamW
            self.opt = opt = cls(self.parameters(), lr=1e-2, weight_decay=0.01, **options)
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    straight, resumed = lightning_straight_and_resumed(Module, 2, f"lightning-{wrap:d}")
    return {
        "params": params_of(straight.net),
        "resumed": params_of(resumed.net),
        "logged_norms": straight.logged,
        "state": state_kinds(straight.opt),
    }


def lightning_finetuning(wrap: bool) -> dict:
    """Lightning's BackboneFinetuning: the optimizer is built over the head,
    the callback unfreezes the backbone at the second epoch and adds it with
    ``optimizer.add_param_group`` (at a tenth of the head's lr, raised each
    epoch), as fine-tuning a pretrained network goes; 3 epochs straight, and
    2 epochs, a checkpoint, a new Trainer resuming from it for the third."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import BackboneFinetuning

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            net = mlp()
            self.backbone, self.head = net[:3], net[3]
            self.logged = []

        def training_step(self, batch, i):
            return F.mse_loss(self.head(self.backbone(batch[0])), batch[1])

        def on_before_optimizer_step(self, optimizer):
            from pytorch_lightning.utilities import grad_norm

            self.logged.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))

        def configure_optimizers(self):
            cls = ak.AdamW if wrap else torch.optim.AdamW
            self.opt = cls(self.head.parameters(), lr=1e-2, weight_decay=0.01, eps=ADAM_EPS)
            return self.opt

    def callbacks():
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5, verbose=False)]

    # Resuming, BaseFinetuning assigns the saved groups to optimizer.param_groups.
    straight, resumed = lightning_straight_and_resumed(Module, 3, f"finetuning-{wrap:d}", callbacks)
    return {
        "params": [p.detach().double().flatten().tolist() for p in straight.parameters()],
        "resumed": [p.detach().double().flatten().tolist() for p in resumed.parameters()],
        "logged_norms": straight.logged,
        "groups": [(len(g["params"]), g["lr"]) for g in straight.opt.param_groups],
        "resumed_groups": [(len(g["params"]), g["lr"]) for g in resumed.opt.param_groups],
    }


def accelerate_state(wrap: bool, state_dtype: str | None = None) -> dict:
    """accelerator.save_state after 2 windows, load_state into fresh objects,
    2 more windows; against 4 windows straight. ``state_dtype``: ours's."""
    import shutil

    from accelerate import Accelerator

    x, y = regression_data()
    folder = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ak-accelerate-{wrap:d}-{os.getpid()}")

    def setup():
        accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
        model = mlp()
        options = {} if state_dtype is None or not wrap else {"state_dtype": state_dtype}
        opt = (ak.AdamW if wrap else torch.optim.AdamW)(model.parameters(), lr=1e-2, weight_decay=0.01, **options)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
        return accelerator, *accelerator.prepare(model, opt, loader, scheduler)

    def train(accelerator, model, opt, loader, scheduler, windows):
        batches = iter(loader)
        for _ in range(windows * 4):
            xb, yb = next(batches)
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb), yb))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                scheduler.step()
                opt.zero_grad()

    accelerator, model, opt, loader, scheduler = setup()
    train(accelerator, model, opt, loader, scheduler, 4)
    straight = params_of(accelerator.unwrap_model(model))
    state = state_kinds(opt)
    accelerator, model, opt, loader, scheduler = setup()
    train(accelerator, model, opt, loader, scheduler, 2)
    accelerator.save_state(folder)
    accelerator, model, opt, loader, scheduler = setup()
    accelerator.load_state(folder)
    xs, ys = x[32:], y[32:]  # the last 2 windows' batches
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=4))
    train(accelerator, model, opt, loader, scheduler, 2)
    shutil.rmtree(folder, ignore_errors=True)
    return {"params": straight, "resumed": params_of(accelerator.unwrap_model(model)), "state": state}


# ---- what the frameworks must not train silently wrong --------------------------------


def _error_of(run) -> str | None:
    try:
        run()
    except RuntimeError as e:
        return str(e)
    return None


def accum_steps_under_frameworks() -> dict:
    """accum_steps=4 given to the wrapper while each framework counts the
    window too (gradient_accumulation_steps / accumulate_grad_batches = 4):
    the error each run stops with, and whether any param moved."""
    import pytorch_lightning as pl

    out = {}

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, i):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return make_optimizer(self.parameters(), True, accum_steps=4)

    module = Module()
    before = params_of(module.net)
    x, y = regression_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer = lightning_trainer(max_epochs=1, accumulate_grad_batches=4, gradient_clip_val=CLIP)
    out["lightning"] = _error_of(lambda: trainer.fit(module, loader))
    out["lightning_moved"] = params_of(module.net) != before

    class Manual(Module):
        """Manual optimization, where Lightning refuses accumulate_grad_batches
        and counts each step() call as a global step."""

        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, i):
            self.manual_backward(F.mse_loss(self.net(batch[0]), batch[1]))
            self.optimizers().step()

    out["lightning_manual"] = _error_of(lambda: lightning_trainer(max_epochs=1).fit(Manual(), loader))

    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=4, cpu=True)
    model = mlp()
    opt = make_optimizer(model.parameters(), True, accum_steps=4)
    model, opt, loader = accelerator.prepare(model, opt, loader)

    def accelerate_loop():
        for xb, yb in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(xb), yb))
                opt.step()
                opt.zero_grad()

    out["accelerate"] = _error_of(accelerate_loop)

    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=os.environ.get("TMPDIR", "/tmp") + "/ak-hf-refusal",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        max_steps=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
    )
    llama = tiny_llama()
    hf_opt = make_optimizer(llama.parameters(), True, accum_steps=4)
    trainer = Trainer(
        model=llama,
        args=args,
        train_dataset=TokenData(),
        optimizers=(hf_opt, torch.optim.lr_scheduler.LambdaLR(hf_opt, lambda s: 1.0)),
    )
    out["hf_trainer"] = _error_of(trainer.train)
    return out


SINGLE_RUNS = {"accum_steps_under_frameworks": accum_steps_under_frameworks}

RUNS = {
    "hf_trainer_class": hf_trainer_class,
    "lightning_class": lightning_class,
    "lightning_finetuning": lightning_finetuning,
    "accelerate_state": accelerate_state,
    "hf_trainer": hf_trainer,
    "accelerate_loop": accelerate_loop,
    "accelerate_skipped_window": accelerate_skipped_window,
    "lightning": lightning,
    "own_loop_scaler": own_loop_scaler,
}


def main() -> None:
    name, options = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if name in SINGLE_RUNS:
        result = SINGLE_RUNS[name](**options)
    else:
        result = {}
        for wrap in (False, True):
            result["ours" if wrap else "plain"] = RUNS[name](wrap=wrap, **options)
    rank = int(os.environ.get("RANK", "0"))
    out = os.environ.get("AK_RESULT_FILE")
    if out:
        with open(f"{out}.rank{rank}", "w") as f:
            json.dump(result, f)
    elif rank == 0:
        print(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        from accumkernels.testing import exit_skipping_teardown

        exit_skipping_teardown(0)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
