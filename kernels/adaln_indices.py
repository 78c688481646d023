"""adaln_indices: the per-row AdaLN table index idx = ti * 3 + tag of a packed sequence, checked on the device.

One thread per row (256 per CTA): ti = timestep_indices[s], tag = token_tags[s]; a row with ti outside
[0, T) or tag outside {0, 1, 2} gets idx = -1 (every h3 row op writes NaN for it, never clamps) and is
recorded in the check slot of its argument (kernels/rowwise.py `record_bad_row`, h3cute/launch/checks.py:
ti first, since a bad ti makes the tag meaningless). Each row depends only on itself.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int64

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream
from h3cute.widths import MODALITIES

from .rowwise import fake_indices, record_bad_row

THREADS = 256


@cute.kernel
def _kernel(mTi: cute.Tensor, mTag: cute.Tensor, mIdx: cute.Tensor, num_timesteps: Int64, ti_rows: Int64,
            ti_host: Int64, tag_rows: Int64, tag_host: Int64):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    row = Int64(bidx) * THREADS + tidx
    if row < mIdx.shape[0]:
        ti = Int64(mTi[row])
        tag = Int64(mTag[row])
        ti_ok = (ti >= 0) & (ti < num_timesteps)
        tag_ok = (tag >= 0) & (tag < MODALITIES)
        mIdx[row] = cutlass.select_(ti_ok & tag_ok, ti * MODALITIES + tag, Int64(-1))
        if not ti_ok:
            record_bad_row(ti_rows, ti_host, row, num_timesteps)
        elif not tag_ok:
            record_bad_row(tag_rows, tag_host, row, MODALITIES)


@cute.jit
def _launch(mTi, mTag, mIdx, num_timesteps: Int64, ti_rows: Int64, ti_host: Int64, tag_rows: Int64, tag_host: Int64,
            stream):
    _kernel(mTi, mTag, mIdx, num_timesteps, ti_rows, ti_host, tag_rows, tag_host).launch(
        grid=((mIdx.shape[0] + THREADS - 1) // THREADS, 1, 1), block=(THREADS, 1, 1), stream=stream
    )


def build(arch: str):
    s = cute.sym_int()
    return compile_for(arch, _launch, fake_indices(s), fake_indices(s), fake_indices(s), Int64(0), Int64(0), Int64(0),
                       Int64(0), Int64(0), env_stream())


SPECS = [
    KernelSpec(
        name="adaln_indices",
        build=build,
        variants=lambda arch: [dict()],
        ptx_markers=("red.global.min.s64", "st.volatile.global"),
        ptx_forbidden=("atom.",),
    )
]
