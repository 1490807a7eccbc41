"""The op table: every op of accumkernels, once.

What an op computes is stated once, in its ``accumkernels.ops`` docstring
(the formula; csrc/include/accumkernels/formulas.h and
backends/triton/_formulas.py compute it line by line). Its schema is declared
in csrc/ops.cpp, the one op list the C++ side keeps. Everything on the
Python side derives from this table: the native ops' fake kernels
(``accumkernels._fake``), the backends' entry points (``backends.native``,
``backends.triton_backend``), the registry's check that every backend,
the reference included, implements every op (``backends.check_backend``),
and the arguments the Triton custom ops mutate. tests/test_native.py checks
the table against the schemas the extension registers.
"""

from __future__ import annotations

from typing import NamedTuple


class Op(NamedTuple):
    mutates: tuple[str, ...]  # the arguments written in place (``Tensor(a!)`` in the schema)
    returns: str | None  # None: nothing; "scalar": a 0-dim fp32 tensor on the arguments' device


_ADAM_MUTATES = (
    "params",
    "buffers",
    "exp_avgs",
    "exp_avg_sqs",
    "max_exp_avg_sqs",
    "state_steps",
    "master_params",
    "exp_avg_scales",  # 8-bit state (accumkernels._state8): the block scales of the uint8 codes
    "exp_avg_sq_scales",
)

OPS: dict[str, Op] = {
    "accumulate_": Op(("buffers", "found_inf"), None),
    "sgd_step_and_zero_": Op(
        ("params", "buffers", "momentum_buffers", "master_params", "momentum_buffer_scales"), None
    ),
    "adam_step_and_zero_": Op(_ADAM_MUTATES, None),
    "adamw_step_and_zero_": Op(_ADAM_MUTATES, None),
    "grad_norm": Op((), "scalar"),
}
