"""Launch plans (h3cute.launch.plan) on CPU: the plan walker issues exactly the launches of the hand-written
launchers it replaced (kernels, static args, every tensor argument's storage, dtype, shape, stride and offset, in
order; fills seen through the folds' inputs), and the outputs are the same tensors; plans are data (one per row
range, printable, encodable for the C++ layer)."""
import pytest
import torch

from h3cute import runtime
from h3cute.kernels._linear_configs import splits, wgrad_rows
from h3cute.launch import (adaln_projection, adaln_row_gather, checks, final_adaln_out, gate_residual,
                           gate_residual_norm_modulate, linear, norm_modulate, timestep_mlp, timestep_sinusoid)
from h3cute.launch import plan as P
from h3cute.launch.norm_modulate import (FUSED_CAPS, FUSED_CLUSTER, FUSED_ROW_GROUPS, FUSED_STEP, FUSED_VEC, fold,
                                         index_vector, reduction_layout, table_view)
from h3cute.launch.timestep_mlp import (SPLITS, WEIGHT_FC1_TILE, WEIGHT_TILE, WGMMA_K_PAD, WGMMA_ROLES, WGMMA_TILE,
                                        forward_weight_tile, pick_config, transposed, uses_wgmma)
from h3cute.widths import (BLOCK_CHUNKS, BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FREQ, HIDDEN, LINEAR_SHAPES,
                           MLP_HIDDEN, TEMB)

from bitwise import same_bits

# ---- the oracles: the launchers as they were written by hand before plans (kept verbatim, their launches only) ---


def reduction_kernel(name, device, width, cap, windows):
    """launch/norm_modulate.py's helper the hand-written launchers called: the compiled column reduction `name`
    (its windowed variant when the table has more than one window)."""
    if windows > 1:
        return runtime.kernel(name, device, width=width, cap=cap, windowed=True)
    return runtime.kernel(name, device, width=width, cap=cap)


def _old_linear_forward(x, weight, bias):
    n, k = weight.shape
    rows = linear._rows(x, k)
    y = torch.empty((rows.shape[0], n), dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        if bias is None:
            bias = torch.full((n,), -0.0, dtype=torch.float32, device=x.device)
        runtime.kernel("linear_gemm", x.device, **linear.gemm_static("fwd", n, k))(
            rows, linear._aligned(weight), linear._aligned(bias), y)
    return y.view(*x.shape[:-1], n)


def _old_linear_backward(grad, x, weight, x_grad=True):
    n, k = weight.shape
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    g = linear._rows(grad, n)
    rows = g.shape[0]
    if rows == 0:
        return (torch.empty(x.shape if x_grad else (0, k), **f32), torch.zeros((n, k), **f32),
                torch.zeros((n,), **f32))

    def gemm(role):
        return runtime.kernel("linear_gemm", dev, **linear.gemm_static(role, n, k))

    def fold_(parts):
        return runtime.kernel("linear_fold", dev, splits=parts, width=k)

    w = linear._aligned(weight)
    dx = torch.empty((0, k), **f32)
    if x_grad:
        parts = splits("dgrad", n, k)
        dx = torch.empty((parts, rows, k), **f32)
        gemm("dgrad")(g, transposed(w), dx)
        if parts > 1:
            folded = torch.empty((rows, k), **f32)
            fold_(parts)(dx, folded[0, :1], folded)
            dx = folded
        dx = dx.view(x.shape)
    xr = linear._rows(x, k)
    bulk, tail = wgrad_rows(n, k, rows)
    if not bulk:
        dweight = torch.empty((1, n, k), **f32)
        gemm("wgrad_tail")(transposed(g), transposed(xr), dweight)
        dweight = dweight[0]
    else:
        chunks = splits("wgrad", n, k)
        partials = torch.empty((chunks + 1, n, k), **f32)
        gemm("wgrad")(transposed(g[:bulk]), transposed(xr[:bulk]), partials[:chunks])
        if tail:
            gemm("wgrad_tail")(transposed(g[bulk:]), transposed(xr[bulk:]), partials[chunks:])
        else:
            partials[chunks].zero_()
        dweight = torch.empty((n, k), **f32)
        fold_(chunks + 1)(partials, dweight[0, :1], dweight)
    return dx, dweight, g.sum(0)


def _old_gate_residual_forward(residual, y, gate, idx, check_indices=True):
    width = y.shape[-1]
    out = torch.empty_like(y)
    if y.shape[0]:
        runtime.kernel("gate_residual_fwd", y.device, width=width)(
            residual, y, gate, idx, out, *checks.slot_addresses(y.device, "gate_residual", "adaln_indices",
                                                                check_indices))
    return out


def _old_gate_residual_backward(grad, y, gate, idx):
    width, table_rows, device = y.shape[-1], gate.shape[0], y.device
    dy = torch.empty_like(y)
    dgate = torch.empty((table_rows, width), dtype=torch.bfloat16, device=device)
    if y.shape[0] == 0:
        return dy, dgate.zero_()
    cap, windows, groups = reduction_layout(table_rows, device)
    partials = torch.empty((groups, table_rows, width), dtype=torch.float32, device=device)
    reduction_kernel("gate_residual_bwd", device, width, cap, windows)(grad, y, gate, idx, dy, partials)
    return dy, fold(partials, dgate)


def _old_norm_modulate_forward_rows(x, weight, shift, scale, idx, eps, op="norm_modulate", argument="adaln_indices",
                                    check=True):
    width = x.shape[-1]
    shift = table_view(op, "shift", shift, width)
    scale = table_view(op, "scale", scale, width)
    idx = index_vector(op, idx, x.shape[0])
    out = torch.empty_like(x)
    if x.shape[0]:
        runtime.kernel("norm_modulate_fwd", x.device, width=width)(
            x, weight, shift, scale, idx, out, float(eps), *checks.slot_addresses(x.device, op, argument, check))
    return out


def _old_norm_modulate_backward_rows(grad, x, weight, scale, idx, eps, op="norm_modulate_backward", table_grad=False):
    width = x.shape[-1]
    scale = table_view(op, "scale", scale, width)
    idx = index_vector(op, idx, x.shape[0])
    table_rows = scale.shape[0]
    num_rows, device = x.shape[0], x.device
    cap, windows, groups = reduction_layout(table_rows, device)
    dx = torch.empty_like(x)
    grads = torch.empty((1 + 2 * table_rows) * width, dtype=torch.bfloat16, device=device)
    dweight, rows = grads[:width], grads[width:]
    if table_grad:
        outputs = (dx, dweight, rows.view(table_rows, 2 * width))
    else:
        outputs = (dx, dweight, rows[:table_rows * width].view(table_rows, width),
                   rows[table_rows * width:].view(table_rows, width))
    if num_rows == 0:
        grads.zero_()
        return outputs
    fused = windows == 1 and cap in FUSED_CAPS and width % (FUSED_VEC * 32 * FUSED_CLUSTER) == 0
    if fused:
        groups = FUSED_ROW_GROUPS[runtime.arch_of(device)][cap]
    partials = torch.empty((groups, (1 + 2 * table_rows) * width), dtype=torch.float32, device=device)
    part_w = partials[:, :width]
    if windows > 1:
        part_w = torch.empty((windows * groups, width), dtype=torch.float32, device=device)
    if table_grad:
        part_rows = partials[:, width:].view(groups, table_rows, 2 * width)
        part_shift, part_scale = part_rows[:, :, :width], part_rows[:, :, width:]
    else:
        part_shift = partials[:, width:(1 + table_rows) * width].view(groups, table_rows, width)
        part_scale = partials[:, (1 + table_rows) * width:].view(groups, table_rows, width)
    if fused:
        runtime.kernel("norm_modulate_bwd_fused", device, width=width, cap=cap, step=FUSED_STEP)(
            grad, x, weight, scale, idx, dx, part_w, part_shift, part_scale, float(eps))
    else:
        rstd = torch.empty(num_rows, dtype=torch.float32, device=device)
        runtime.kernel("norm_modulate_bwd_rows", device, width=width)(grad, x, weight, scale, idx, dx, rstd,
                                                                      float(eps))
        reduction_kernel("norm_modulate_bwd_params", device, width, cap, windows)(
            grad, x, weight, scale, idx, rstd, part_w, part_shift, part_scale)
    if windows > 1:
        fold(part_w, dweight)
        fold(partials[:, width:], rows)
    else:
        fold(partials, grads)
    return outputs


def _old_gate_residual_norm_modulate_forward(residual, y, gate, weight, shift, scale, idx, eps, check_indices=True,
                                              vec=gate_residual_norm_modulate.FORWARD_VEC):
    op, width = "gate_residual_norm_modulate", y.shape[-1]
    gate, shift, scale = (table_view(op, name, t, width) for name, t in (("gate", gate), ("shift", shift),
                                                                         ("scale", scale)))
    idx = index_vector(op, idx, y.shape[0])
    h, out = torch.empty_like(y), torch.empty_like(y)
    if y.shape[0]:
        runtime.kernel(f"{op}_fwd", y.device, width=width, vec=vec)(
            residual, y, gate, weight, shift, scale, idx, h, out, float(eps),
            *checks.slot_addresses(y.device, op, "adaln_indices", check_indices))
    return h, out


def _old_adaln_row_gather_forward(table, adaln_indices, check_indices=True):
    op = "adaln_row_gather"
    width = table.shape[-1] // BLOCK_CHUNKS
    table = table_view(op, "table", table, BLOCK_CHUNKS * width)
    idx = index_vector(op, adaln_indices, adaln_indices.shape[0])
    outs = [torch.empty((idx.shape[0], width), dtype=table.dtype, device=table.device) for _ in range(BLOCK_CHUNKS)]
    if idx.shape[0]:
        runtime.kernel("adaln_row_gather_fwd", table.device, width=width)(
            table, idx, *outs, *checks.slot_addresses(table.device, op, "adaln_indices", check_indices))
    return tuple(outs)


def _old_adaln_row_gather_backward(*args):
    *grads, adaln_indices, table_rows = args
    op = "adaln_row_gather_backward"
    width = grads[0].shape[-1]
    num_rows = grads[0].shape[0]
    idx = index_vector(op, adaln_indices, num_rows)
    device = grads[0].device
    d_table = torch.empty((table_rows, BLOCK_CHUNKS * width), dtype=torch.bfloat16, device=device)
    if num_rows == 0 or table_rows == 0:
        return d_table.zero_()
    cap, windows, groups = reduction_layout(table_rows, device)
    partials = torch.empty((groups, table_rows, BLOCK_CHUNKS * width), dtype=torch.float32, device=device)
    reduction_kernel("adaln_row_gather_bwd", device, width, cap, windows)(*grads, idx, partials)
    return fold(partials, d_table)


def _old_timestep_sinusoid_forward(t, check_range=True):
    num_rows = t.shape[0]
    out = torch.empty((num_rows, FREQ), dtype=torch.float32, device=t.device)
    if num_rows:  # a zero-sized grid is not a valid launch
        _old_timestep_sinusoid_launch(t, out, check_range)
    return out


def _old_timestep_sinusoid_launch(t, out, check_range=False):
    device = t.device  # (the launcher's kernel cache keyed this by the CUDA device index)
    runtime.kernel("timestep_sinusoid", device, width=FREQ, check_range=bool(check_range))(
        t, out, *checks.slot_addresses(device, "timestep_sinusoid", "t", check_range))


def _old_mlp_gemm(device, role, tile):
    return runtime.kernel("timestep_mlp_gemm", device, role=role, tile=tile.astuple())


def _old_mlp_fold(device, role, mode):
    return runtime.kernel("timestep_mlp_fold", device, role=role, mode=mode)


def _old_mlp_wgmma_gemm(device, role):
    k, splits = WGMMA_ROLES[role]
    return runtime.kernel("tf32x3_wgmma_gemm", device, k=k, splits=splits, tile=WGMMA_TILE)


def _old_mlp_weight_gemm(device, role, tile=WEIGHT_TILE):
    return runtime.kernel("tf32x3_wgmma_weight_gemm", device, role=role, tile=tile)


def _old_mlp_split(x):
    big, small = torch.empty_like(x), torch.empty_like(x)
    runtime.kernel("tf32_split", x.device, transpose=False)(x, big, small)
    return big, small


def _old_mlp_split_transposed(xt, depth_out):
    shape = (xt.shape[1], depth_out)
    big, small = xt.new_empty(shape), xt.new_empty(shape)
    runtime.kernel("tf32_split", xt.device, transpose=True)(xt, big, small)
    return big, small


def _old_mlp_fc1(x, w1, b1, tile, wgmma=False):
    num_rows = x.shape[0]
    z = torch.empty((num_rows, MLP_HIDDEN), dtype=torch.float32, device=x.device)
    h = torch.empty_like(z)
    if wgmma:
        _old_mlp_weight_gemm(x.device, "fc1_zh", WEIGHT_FC1_TILE)(w1, *_old_mlp_split(x), b1, z, h)
    else:
        _old_mlp_gemm(x.device, "fc1_zh", tile)(x, w1, b1, z, h)
    return z, h


def _old_mlp_forward(x, w1, b1, w2, b2, config=None, wgmma=None):
    num_rows = x.shape[0]
    dev = x.device
    out = torch.empty((num_rows, TEMB), dtype=torch.float32, device=dev)
    if num_rows == 0:
        return out
    cfg = config or pick_config(num_rows)
    partials = torch.empty((SPLITS["fc2"], num_rows, TEMB), dtype=torch.float32, device=dev)
    if wgmma is None:
        tile = forward_weight_tile(dev, num_rows)
    else:
        tile = (forward_weight_tile(dev, num_rows) or WEIGHT_TILE) if wgmma else None
    if tile is not None:
        h_big, h_small = (torch.empty((num_rows, MLP_HIDDEN), dtype=torch.float32, device=dev) for _ in range(2))
        if tile == WEIGHT_TILE:
            _old_mlp_weight_gemm(dev, "fc1_split", WEIGHT_FC1_TILE)(w1, *_old_mlp_split(x), b1, h_big, h_small)
        else:
            _old_mlp_gemm(dev, "fc1_split", cfg.fc1)(x, w1, b1, h_big, h_small)
        _old_mlp_weight_gemm(dev, "fc2", tile)(w2, h_big, h_small, partials)
    else:
        h = torch.empty((num_rows, MLP_HIDDEN), dtype=torch.float32, device=dev)
        _old_mlp_gemm(dev, "fc1", cfg.fc1)(x, w1, b1, h)
        _old_mlp_gemm(dev, "fc2", cfg.fc2)(h, w2, partials)
    _old_mlp_fold(dev, "fc2", "bias")(partials, b2, out)
    return out


def _old_mlp_backward(grad, x, w1, b1, w2, config=None, wgmma=None):
    num_rows = x.shape[0]
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    if num_rows == 0:
        return (torch.empty((0, FREQ), **f32), torch.zeros_like(w1), torch.zeros_like(b1),
                torch.zeros_like(w2), torch.zeros((TEMB,), **f32))
    cfg = config or pick_config(num_rows)
    use_wgmma = uses_wgmma(dev, num_rows) if wgmma is None else wgmma
    z, h = _old_mlp_fc1(x, w1, b1, cfg.fc1, use_wgmma)

    dh_partials = torch.empty((SPLITS["fc2_dgrad"], num_rows, MLP_HIDDEN), **f32)
    if use_wgmma:
        _old_mlp_weight_gemm(dev, "fc2_dgrad")(transposed(w2), *_old_mlp_split(grad), dh_partials)
    else:
        _old_mlp_gemm(dev, "fc2_dgrad", cfg.fc2_dgrad)(grad, transposed(w2), dh_partials)
    dz = torch.empty((num_rows, MLP_HIDDEN), **f32)
    db1 = torch.empty((MLP_HIDDEN,), **f32)
    runtime.kernel("timestep_mlp_colsum", dev, cols=MLP_HIDDEN, fold_dz=True)(dh_partials, z, dz, db1)

    dx_partials = torch.empty((SPLITS["fc1_dgrad"], num_rows, FREQ), **f32)
    _old_mlp_gemm(dev, "fc1_dgrad", cfg.fc1_dgrad)(dz, transposed(w1), dx_partials)
    dx = torch.empty((num_rows, FREQ), **f32)
    # the one edit: the never-read (1,) aux operand is dx's first element, as the C++ launcher passed it (the
    # Python launcher allocated it: dx.new_empty((1,)))
    _old_mlp_fold(dev, "fc1_dgrad", "sum")(dx_partials, dx.view(-1)[:1], dx)

    dw2 = torch.empty((1, TEMB, MLP_HIDDEN), **f32)
    if use_wgmma:
        depth = -(-num_rows // WGMMA_K_PAD) * WGMMA_K_PAD
        _old_mlp_wgmma_gemm(dev, "fc2_wgrad")(*_old_mlp_split_transposed(grad, depth),
                                              *_old_mlp_split_transposed(h, depth), dw2)
    else:
        _old_mlp_gemm(dev, "fc2_wgrad", cfg.fc2_wgrad)(transposed(grad), transposed(h), dw2)
    dw1 = torch.empty((1, MLP_HIDDEN, FREQ), **f32)
    _old_mlp_gemm(dev, "fc1_wgrad", cfg.fc1_wgrad)(transposed(dz), transposed(x), dw1)

    db2 = torch.empty((TEMB,), **f32)
    runtime.kernel("timestep_mlp_colsum", dev, cols=TEMB, fold_dz=False)(grad, grad, grad, db2)
    return dx, dw1[0], db1, dw2[0], db2


def _old_silu_bf16(temb):
    temb = adaln_projection.dense16(temb)
    act = torch.empty(temb.shape, dtype=torch.bfloat16, device=temb.device)
    runtime.kernel("adaln_silu_cast", temb.device, width=TEMB)(temb, act)
    return act


def _old_projection_forward(temb, weight, bias, config=None):
    L, dense16 = adaln_projection, adaln_projection.dense16
    L._check_config("forward", "fwd", config)
    rows, out_features = temb.shape[0], weight.shape[0]
    out = torch.empty((rows, out_features), dtype=torch.bfloat16, device=temb.device)
    if rows == 0:  # a zero-sized grid is not a valid launch
        return out
    act = _old_silu_bf16(temb)
    wgmma = L._uses_wgmma(temb.device, config)
    fn = runtime.kernel("adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd", temb.device,
                        out_features=out_features,
                        config=config or L.config_for_rows(rows, wgmma, runtime.sm_count(temb.device)))
    fn(act, dense16(weight), dense16(bias), out)
    return out


def _old_projection_backward(grad, temb, weight, config=None, fold_warps=None):
    L, dense16 = adaln_projection, adaln_projection.dense16
    L._check_config("backward", "dgrad", config)
    rows, out_features = temb.shape[0], weight.shape[0]
    device = temb.device
    if rows == 0:
        return temb.new_empty((0, TEMB)), torch.zeros_like(weight), weight.new_zeros((out_features,))
    grad, temb, weight = dense16(grad), dense16(temb), dense16(weight)
    wgmma = L._uses_wgmma(device, config)
    sms = runtime.sm_count(device)
    wgrad_config = L.wgrad_config_for_rows(rows, wgmma, sms)
    folds = L.wgrad_folds(wgrad_config, wgmma) if fold_warps is None else fold_warps
    if folds and not L.wgrad_folds(wgrad_config, wgmma):
        raise ValueError(f"adaln_projection backward: the dW tile {wgrad_config!r} at T = {rows} has no fold warps")
    act = _old_silu_bf16(temb) if folds else torch.empty((rows, TEMB), dtype=torch.bfloat16, device=device)
    partial = torch.empty((L.DGRAD_SPLITS, rows, TEMB), dtype=torch.float32, device=device)
    runtime.kernel("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", device, out_features=out_features,
                   config=config or L.dgrad_config_for_rows(rows, wgmma, sms))(grad, weight, partial)
    dtemb = torch.empty((rows, TEMB), dtype=torch.float32, device=device)
    dweight = torch.empty_like(weight)
    dbias = torch.empty((out_features,), dtype=torch.bfloat16, device=device)
    if folds:
        blocks = torch.empty((-(-rows // L.DBIAS_ROW_BLOCK), out_features), dtype=torch.float32, device=device)
        runtime.kernel("adaln_proj_wgrad_fold", device, out_features=out_features, config=wgrad_config)(
            grad, act, dweight, dbias, partial, temb, dtemb, blocks)
        return dtemb, dweight, dbias
    runtime.kernel("adaln_dtemb_fold", device, width=TEMB)(partial, temb, dtemb, act)  # act = bf16(silu(temb))
    if wgmma:
        wgrad = runtime.kernel("adaln_proj_wgrad_wgmma", device, out_features=out_features, wgmma=True,
                               config=wgrad_config)
    else:
        wgrad = runtime.kernel("adaln_proj_wgrad", device, out_features=out_features, config=wgrad_config)
    wgrad(grad, act, dweight, dbias)
    if not L.wgrad_writes_dbias(wgrad_config, rows):
        bias_partial = torch.empty((-(-rows // L.DBIAS_ROW_BLOCK), out_features), dtype=torch.float32, device=device)
        runtime.kernel("adaln_bias_grad", device, out_features=out_features)(grad, bias_partial, dbias)
    return dtemb, dweight, dbias


def _old_final_forward_with_table(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps=1e-5,
                                  check_indices=True):
    # launch/final_adaln_out.py forward_with_table, its callees the oracles above
    table = _old_projection_forward(temb, proj_weight, proj_bias)
    out = _old_norm_modulate_forward_rows(x, norm_weight, table[:, :HIDDEN], table[:, HIDDEN:], timestep_indices, eps,
                                          op="final_adaln_out", argument="timestep_indices", check=check_indices)
    return out, table


def _old_final_backward(grad, x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps, table=None):
    # launch/final_adaln_out.py backward, its callees the oracles above
    if table is None:
        table = _old_projection_forward(temb, proj_weight, proj_bias)
    dx, dnorm_weight, dproj = _old_norm_modulate_backward_rows(
        grad, x, norm_weight, table[:, HIDDEN:], timestep_indices, eps, op="final_adaln_out_backward", table_grad=True
    )  # dproj (T, 10752) BF16: [dshift | dscale] per timestep, like the table
    dtemb, dproj_weight, dproj_bias = _old_projection_backward(dproj, temb, proj_weight)
    return dx, dnorm_weight, dtemb, dproj_weight, dproj_bias


def _old_final_kernel_handles(dev, backward, num_rows):
    """launch/final_adaln_out.py kernel_handles (its kernels and launch constants; the C handles and T range left
    out): what h3_native.cpp's hand-written final_adaln_out impls launched."""
    wgmma = adaln_projection._uses_wgmma(dev, None)
    sms = runtime.sm_count(dev)
    fwd = adaln_projection.config_for_rows(num_rows, wgmma, sms)
    head = [runtime.kernel("adaln_silu_cast", dev, width=TEMB),
            runtime.kernel("adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd", dev, out_features=FINAL_PROJECTION,
                           config=fwd)]
    if not backward:
        fns = head + [runtime.kernel("norm_modulate_fwd", dev, width=HIDDEN)]
        op, arg = "final_adaln_out", "timestep_indices"
        return fns, [*checks.slot_addresses(dev, op, arg), *checks.slot_addresses(dev, op, arg, False)]
    dgrad = adaln_projection.dgrad_config_for_rows(num_rows, wgmma, sms)
    wgrad = adaln_projection.wgrad_config_for_rows(num_rows, wgmma, sms)
    cap = norm_modulate.table_rows_cap(num_rows)
    if cap not in norm_modulate.FUSED_CAPS or num_rows > adaln_projection.FUSED_DBIAS_ROWS:
        raise ValueError(f"final_adaln_out: the C++ backward takes T <= 24, got {num_rows}")
    fns = head + [
        runtime.kernel("norm_modulate_bwd_fused", dev, width=HIDDEN, cap=cap, step=norm_modulate.FUSED_STEP),
        runtime.kernel("rowwise_fold", dev),
        runtime.kernel("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", dev, out_features=FINAL_PROJECTION,
                       config=dgrad),
        runtime.kernel("adaln_dtemb_fold", dev, width=TEMB),
        runtime.kernel("adaln_proj_wgrad_wgmma", dev, out_features=FINAL_PROJECTION, wgmma=True, config=wgrad) if wgmma
        else runtime.kernel("adaln_proj_wgrad", dev, out_features=FINAL_PROJECTION, config=wgrad),
    ]
    return fns, [FUSED_ROW_GROUPS[runtime.arch_of(dev)][cap]]


# h3_native.cpp's hand-written final_adaln_out impls (their launches, transcribed: tensors where it allocated, views
# where it made Views)


def _old_cpp_projection_forward(fn, temb, weight, bias, out):
    act = torch.empty((temb.shape[0], TEMB), dtype=torch.bfloat16, device=out.device)  # bf16(silu(temb))
    fn[0](temb, act)
    fn[1](act, weight, bias, out)


def _old_cpp_final_forward(x, norm_weight, temb, proj_weight, proj_bias, ti, eps, check_indices):
    timesteps = temb.shape[0]
    fn, params = _old_final_kernel_handles(x.device, 0, timesteps)
    slot = params[0:2] if check_indices else params[2:4]
    proj = torch.empty((timesteps, FINAL_PROJECTION), dtype=torch.bfloat16, device=x.device)
    out = torch.empty_like(x)
    shift, scale = proj[:, :HIDDEN], proj[:, HIDDEN:]
    _old_cpp_projection_forward(fn, temb, proj_weight, proj_bias, proj)
    fn[2](x, norm_weight, shift, scale, ti, out, eps, slot[0], slot[1])
    return out, proj


def _old_cpp_final_backward(grad, x, nw, temb, pw, pb, ti, eps, table=None):
    timesteps, dev = temb.shape[0], x.device
    fn, (groups,) = _old_final_kernel_handles(dev, 1, timesteps)
    proj = table if table is not None else torch.empty((timesteps, FINAL_PROJECTION), dtype=torch.bfloat16,
                                                       device=dev)
    if table is None:
        _old_cpp_projection_forward(fn, temb, pw, pb, proj)
    scale = proj[:, HIDDEN:]
    # norm_backward_fused
    stride = (1 + 2 * timesteps) * HIDDEN
    dx = torch.empty_like(x)
    partials = torch.empty((groups, stride), dtype=torch.float32, device=dev)
    part_w = partials.as_strided((groups, HIDDEN), (stride, 1))
    part_shift = partials.as_strided((groups, timesteps, HIDDEN), (stride, 2 * HIDDEN, 1), HIDDEN)
    part_scale = partials.as_strided((groups, timesteps, HIDDEN), (stride, 2 * HIDDEN, 1), 2 * HIDDEN)
    fn[2](grad, x, nw, scale, ti, dx, part_w, part_shift, part_scale, eps)
    grads = torch.empty((stride,), dtype=torch.bfloat16, device=dev)
    fn[3](partials.as_strided((groups, stride), (stride, 1)), grads.view(-1))
    dweight = grads.narrow(0, 0, HIDDEN)
    dtable = grads.narrow(0, HIDDEN, 2 * timesteps * HIDDEN).view(timesteps, 2 * HIDDEN)
    # projection_backward (T <= 24: db fused into dW)
    partial = torch.empty((adaln_projection.DGRAD_SPLITS, timesteps, TEMB), dtype=torch.float32, device=dev)
    dtemb = torch.empty((timesteps, TEMB), dtype=torch.float32, device=dev)
    act = torch.empty((timesteps, TEMB), dtype=torch.bfloat16, device=dev)
    dpw, dpb = torch.empty_like(pw), torch.empty((pw.shape[0],), dtype=torch.bfloat16, device=dev)
    fn[4](dtable, pw, partial)
    fn[5](partial, temb, dtemb, act)
    fn[6](dtable, act, dpw, dpb)
    return dx, dweight, dtemb, dpw, dpb


# ---- the recorder ---------------------------------------------------------------------------------------------

# The arguments each fake kernel writes (every element of them), by its static args: the launch's outputs, so the
# ops' outputs are deterministic; a fold also records a checksum of the partials it reads (a missed fill would show
# there).
WRITES = {"linear_gemm": (-1,), "linear_fold": (-1,), "gate_residual_fwd": (4,), "gate_residual_bwd": (4, 5),
          "rowwise_fold": (-1,), "norm_modulate_fwd": (5,), "norm_modulate_bwd_fused": (5, 6, 7, 8),
          "norm_modulate_bwd_rows": (5, 6), "norm_modulate_bwd_params": (6, 7, 8),
          "gate_residual_norm_modulate_fwd": (7, 8), "adaln_row_gather_fwd": tuple(range(2, 2 + BLOCK_CHUNKS)),
          "adaln_row_gather_bwd": (-1,), "timestep_sinusoid": (1,),
          "timestep_mlp_fold": (-1,), "tf32x3_wgmma_gemm": (-1,), "tf32_split": (1, 2),
          # fc1 writes h; fc1_split h's operand pair; fc1_zh z and h; the others their last argument
          "timestep_mlp_gemm": lambda static: {"fc1": (3,), "fc1_split": (3, 4), "fc1_zh": (3, 4)}.get(
              static["role"], (-1,)),
          "tf32x3_wgmma_weight_gemm": lambda static: (-2, -1) if static["role"].startswith("fc1") else (-1,),
          "timestep_mlp_colsum": lambda static: (2, 3) if static["fold_dz"] else (3,),
          "adaln_silu_cast": (1,), "adaln_proj_fwd": (-1,), "adaln_proj_fwd_wgmma": (-1,), "adaln_proj_dgrad": (-1,),
          "adaln_proj_dgrad_wgmma": (-1,), "adaln_dtemb_fold": (2, 3), "adaln_proj_wgrad": (2, 3),
          "adaln_proj_wgrad_wgmma": (2, 3), "adaln_bias_grad": (1, 2), "adaln_proj_wgrad_fold": (2, 3, 6, 7)}
FOLDS = {"linear_fold", "rowwise_fold", "timestep_mlp_fold", "timestep_mlp_colsum", "adaln_dtemb_fold"}


class _Recorder:
    """Stands in for runtime.kernel: each kernel records its calls as (name, static args, arguments), a tensor
    argument as (storage, dtype, shape, stride, storage offset) with its storage named after the op input it
    belongs to or numbered in order of first use; it writes its outputs with its call's ordinal."""

    def __init__(self, inputs: dict):
        # (an empty input holds no memory: its null pointer is not the input's to name)
        self.inputs = {t.untyped_storage().data_ptr(): name for name, t in inputs.items()
                       if t is not None and t.untyped_storage().nbytes()}
        self.calls, self.storages = [], {}
        self.regions = {}  # storage pointer -> [(start, numel)] of the plan buffers carved from it

    def allocated(self, buffers: dict) -> dict:
        """Registers a plan walk's buffers (plan.allocate's): a buffer carved from an arena is named as if it were
        its own allocation, its offsets counted from its start."""
        for t in buffers.values():
            self.regions.setdefault(t.untyped_storage().data_ptr(), []).append((t.storage_offset(), t.numel()))
        return buffers

    def storage(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.inputs:
            return self.inputs[ptr], 0
        offset, reach = t.storage_offset(), _span(t)
        numel, start = min(((numel, start) for start, numel in self.regions.get(ptr, [])
                            if start <= offset and offset + reach <= start + numel), default=(0, 0))
        key = (ptr, start, numel)
        if key not in self.storages:  # kept alive: its memory is never another buffer's during the run
            self.storages[key] = (f"buffer{len(self.storages)}", storage)
        return self.storages[key][0], start

    def describe(self, a):
        if isinstance(a, torch.Tensor):
            name, start = self.storage(a)
            return (name, a.dtype, tuple(a.shape), a.stride(), a.storage_offset() - start)
        return a

    def __call__(self, name, device, **static):
        recorder = self

        class Fake:
            def __call__(self, *args):
                record = [name, tuple(sorted(static.items())), [recorder.describe(a) for a in args]]
                if name in FOLDS:
                    record.append(float(args[0].double().sum()))
                recorder.calls.append(tuple(record))
                writes = WRITES[name]
                for i in writes(static) if callable(writes) else writes:
                    args[i].fill_(len(recorder.calls))

            def __chandle__(self):
                return 1000 + len(recorder.calls)

        return Fake()

    def outputs(self, outs):
        return [self.describe(t) for t in outs]


def _span(t) -> int:
    """The elements from t's first to one past its last (0 when empty)."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))


_EMPTY, _EMPTY_LIKE, _ALLOCATE = torch.empty, torch.empty_like, P.allocate


def _run(monkeypatch, fn, inputs: dict, *extra):
    """(calls, outputs' descriptions, outputs) of fn(*inputs.values(), *extra) with recorded fake kernels and
    poisoned allocations (an element neither a kernel nor a fill writes shows in a fold's checksum or an output)."""
    recorder = _Recorder(inputs)
    monkeypatch.setattr(runtime, "kernel", recorder)
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: _EMPTY(*a, **kw).fill_(7.0))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: _EMPTY_LIKE(*a, **kw).fill_(7.0))
    monkeypatch.setattr(P, "_cache", {})  # plans resolve their kernels through this recorder
    monkeypatch.setattr(P, "allocate", lambda *a: recorder.allocated(_ALLOCATE(*a)))
    outs = fn(*inputs.values(), *extra)
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    return recorder.calls, recorder.outputs(outs), outs


def _same_run(monkeypatch, old, new, inputs, *extra):
    calls, described, outs = _run(monkeypatch, old, inputs, *extra)
    new_calls, new_described, new_outs = _run(monkeypatch, new, inputs, *extra)
    assert new_calls == calls
    assert new_described == described
    assert all(same_bits(a, b) for a, b in zip(new_outs, outs, strict=True))
    return calls


@pytest.fixture
def fake_device(monkeypatch):
    monkeypatch.setattr(runtime, "arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    slots = {}  # check slot addresses as (op, argument, checked) stand-ins: no CUDA memory on a CPU machine
    monkeypatch.setattr(checks, "slot_addresses", lambda device, op, arg, checked=True:
                        slots.setdefault((op, arg, checked), (2 * len(slots) + 1, 2 * len(slots) + 2)))


HEADS = range(len(LINEAR_SHAPES))


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("rows", [0, 1, 255, 256, 257, 4097])
def test_linear_plans_launch_what_the_hand_written_launcher_did(monkeypatch, fake_device, head, rows):
    n, k = LINEAR_SHAPES[head]
    gen = torch.Generator().manual_seed(rows + 17 * head)
    x, weight = torch.randn((rows, k), generator=gen), torch.randn((n, k), generator=gen)
    bias, grad = torch.randn((n,), generator=gen), torch.randn((rows, n), generator=gen)
    for b in (bias, None):
        inputs = dict(x=x, weight=weight, bias=b)
        calls = _same_run(monkeypatch, _old_linear_forward, linear.forward, inputs)
        assert len(calls) == (rows > 0)
    for x_grad in (True, False):
        calls = _same_run(monkeypatch, _old_linear_backward, linear.backward, dict(grad=grad, x=x, weight=weight),
                          x_grad)
        if rows:  # dgrad (+ its fold), then the weight gradient's GEMMs (+ its fold)
            launches = x_grad * (1 + (splits("dgrad", n, k) > 1)) + (1 if rows < 256 else 2 + (rows % 256 > 0))
            assert len(calls) == launches, [c[:2] for c in calls]
    # leading dims: (2, rows, K) rows of x, the gradient of the same shape (outputs viewed with x's leading dims)
    x3, g3 = torch.cat([x, x]).view(2, rows, k), torch.cat([grad, grad]).view(2, rows, n)
    _same_run(monkeypatch, _old_linear_forward, linear.forward, dict(x=x3, weight=weight, bias=bias))
    _same_run(monkeypatch, _old_linear_backward, linear.backward, dict(grad=g3, x=x3, weight=weight))


def test_linear_plans_read_strided_and_misaligned_inputs_as_the_launcher_did(monkeypatch, fake_device):
    n, k = LINEAR_SHAPES[0]
    x = torch.randn((300, 2 * k))[:, :k]  # copied into contiguous rows first, as before
    weight = torch.randn(n * k + 1)[1:].view(n, k)  # 4-byte aligned only: copied
    grad = torch.randn((300, n))
    _same_run(monkeypatch, _old_linear_forward, linear.forward, dict(x=x, weight=weight, bias=torch.randn(n)))
    _same_run(monkeypatch, _old_linear_backward, linear.backward, dict(grad=grad, x=x, weight=weight))


@pytest.mark.parametrize("table_rows", [3, 9, 13, 24, 48, 49, 150])  # every cap, and windows beyond 48
@pytest.mark.parametrize("rows", [0, 1, 7, 1031])
def test_gate_residual_plans_launch_what_the_hand_written_launcher_did(monkeypatch, fake_device, table_rows, rows):
    gen = torch.Generator().manual_seed(rows + table_rows)

    def bf16(*shape):
        return torch.randn(shape, generator=gen).bfloat16()

    residual, y, grad = bf16(rows, HIDDEN), bf16(rows, HIDDEN), bf16(rows, HIDDEN)
    idx = torch.randint(0, table_rows, (rows,), generator=gen)
    wide = bf16(table_rows, 2 * HIDDEN)
    for gate in (bf16(table_rows, HIDDEN), wide[:, HIDDEN:]):  # compact, and a row-strided half read in place
        for check in (True, False):
            calls = _same_run(monkeypatch, _old_gate_residual_forward, gate_residual.forward,
                              dict(residual=residual, y=y, gate=gate, adaln_indices=idx), check)
            assert len(calls) == (rows > 0)
        calls = _same_run(monkeypatch, _old_gate_residual_backward, gate_residual.backward,
                          dict(grad=grad, y=y, gate=gate, adaln_indices=idx))
        assert [c[0] for c in calls] == (["gate_residual_bwd", "rowwise_fold"] if rows else [])


@pytest.mark.parametrize("table_rows", [3, 9, 13, 24, 25, 48, 49, 150])  # fused caps, unfused, windows beyond 48
@pytest.mark.parametrize("rows", [0, 1, 7, 1031])
def test_norm_modulate_plans_launch_what_the_hand_written_launcher_did(monkeypatch, fake_device, table_rows, rows):
    gen = torch.Generator().manual_seed(rows + 3 * table_rows)

    def bf16(*shape):
        return torch.randn(shape, generator=gen).bfloat16()

    x, grad, weight = bf16(rows, HIDDEN), bf16(rows, HIDDEN), bf16(HIDDEN)
    idx = torch.randint(0, table_rows, (rows,), generator=gen)
    wide = bf16(table_rows, 2 * HIDDEN)
    # compact tables, the row-strided halves of a projection read in place, and a misaligned table (copied)
    odd = bf16(table_rows, HIDDEN + 4)
    for shift, scale in ((bf16(table_rows, HIDDEN), bf16(table_rows, HIDDEN)), (wide[:, :HIDDEN], wide[:, HIDDEN:]),
                         (odd[:, 4:], odd[:, :HIDDEN])):
        inputs = dict(x=x, weight=weight, shift=shift, scale=scale, adaln_indices=idx)
        for check in (True, False):
            calls = _same_run(monkeypatch, _old_norm_modulate_forward_rows, norm_modulate.forward_rows, inputs, 1e-6,
                              "norm_modulate", "adaln_indices", check)
            assert len(calls) == (rows > 0)
        # final_adaln_out's rows: its own check slot
        _same_run(monkeypatch, _old_norm_modulate_forward_rows, norm_modulate.forward_rows, inputs, 1e-5,
                  "final_adaln_out", "timestep_indices")
        for table_grad in (False, True):
            calls = _same_run(monkeypatch, _old_norm_modulate_backward_rows, norm_modulate.backward_rows,
                              dict(grad=grad, x=x, weight=weight, scale=scale, adaln_indices=idx), 1e-6,
                              "norm_modulate_backward", table_grad)
            want = [] if rows == 0 else ["norm_modulate_bwd_fused", "rowwise_fold"] if table_rows <= 24 else \
                ["norm_modulate_bwd_rows", "norm_modulate_bwd_params", "rowwise_fold"] + ["rowwise_fold"] * \
                (table_rows > 48)
            assert [c[0] for c in calls] == want


@pytest.mark.parametrize("rows", [0, 1, 7, 1031])
def test_gate_residual_norm_modulate_plans_launch_what_the_hand_written_launcher_did(monkeypatch, fake_device, rows):
    gen = torch.Generator().manual_seed(rows)

    def bf16(*shape):
        return torch.randn(shape, generator=gen).bfloat16()

    table_rows = 9
    residual, y, weight = bf16(rows, HIDDEN), bf16(rows, HIDDEN), bf16(HIDDEN)
    idx = torch.randint(0, table_rows, (rows,), generator=gen)
    block = bf16(table_rows, 3 * HIDDEN)  # row-strided chunks of one table, read in place, and compact copies
    for tables in ((block[:, :HIDDEN], block[:, HIDDEN:2 * HIDDEN], block[:, 2 * HIDDEN:]),
                   tuple(bf16(table_rows, HIDDEN) for _ in range(3))):
        inputs = dict(residual=residual, y=y, gate=tables[0], weight=weight, shift=tables[1], scale=tables[2],
                      adaln_indices=idx)
        for check in (True, False):
            for vec in (4, 8):  # the shipped row layout and the one perf/row_kernels.py also times
                calls = _same_run(monkeypatch, _old_gate_residual_norm_modulate_forward,
                                  gate_residual_norm_modulate.forward, inputs, 1e-6, check, vec)
                assert len(calls) == (rows > 0)


@pytest.mark.parametrize("table_rows", [0, 3, 9, 13, 24, 48, 49, 150])  # no rows, every cap, windows beyond 48
@pytest.mark.parametrize("rows", [0, 1, 7, 1031])
def test_adaln_row_gather_plans_launch_what_the_hand_written_launcher_did(monkeypatch, fake_device, table_rows, rows):
    gen = torch.Generator().manual_seed(rows + 5 * table_rows)

    def bf16(*shape):
        return torch.randn(shape, generator=gen).bfloat16()

    idx = torch.randint(0, max(table_rows, 1), (rows,), generator=gen)
    if table_rows:
        wide = bf16(table_rows, BLOCK_TABLE + 8)
        for table in (bf16(table_rows, BLOCK_TABLE), wide[:, 8:], wide[:, 4:BLOCK_TABLE + 4]):  # in place, or copied
            for check in (True, False):
                calls = _same_run(monkeypatch, _old_adaln_row_gather_forward, adaln_row_gather.forward,
                                  dict(table=table, adaln_indices=idx), check)
                assert len(calls) == (rows > 0)
    grads = {f"grad{c}": bf16(rows, HIDDEN) for c in range(BLOCK_CHUNKS)}
    calls = _same_run(monkeypatch, _old_adaln_row_gather_backward,
                      lambda *a: adaln_row_gather.backward(a[:-2], *a[-2:]), dict(grads, adaln_indices=idx), table_rows)
    assert [c[0] for c in calls] == (["adaln_row_gather_bwd", "rowwise_fold"] if rows and table_rows else [])


@pytest.mark.parametrize("rows", [0, 1, 7, 1031])
def test_timestep_sinusoid_plans_launch_what_the_hand_written_launcher_did(monkeypatch, fake_device, rows):
    t = torch.rand(rows, generator=torch.Generator().manual_seed(rows))
    for check in (True, False):
        calls = _same_run(monkeypatch, _old_timestep_sinusoid_forward, timestep_sinusoid.forward, dict(t=t), check)
        assert len(calls) == (rows > 0)
        if rows:  # into a caller's output (the GPU tests' guarded buffers), and a strided t read in place
            def old(t, out, check):
                return _old_timestep_sinusoid_launch(t, out, check) or out

            def new(t, out, check):
                return timestep_sinusoid.launch(t, out, check) or out

            guarded = torch.full((rows + 16, FREQ), float("nan"))
            _same_run(monkeypatch, old, new, dict(t=t, out=guarded[:rows]), check)
            _same_run(monkeypatch, old, new, dict(t=torch.rand(2 * rows)[::2], out=guarded[:rows]), check)


@pytest.fixture(scope="module")
def mlp_weights():
    gen = torch.Generator().manual_seed(5)
    return dict(w1=torch.randn((MLP_HIDDEN, FREQ), generator=gen), b1=torch.randn((MLP_HIDDEN,), generator=gen),
                w2=torch.randn((TEMB, MLP_HIDDEN), generator=gen), b2=torch.randn((TEMB,), generator=gen))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
# each T range of the picks and, on sm_90a, of the forward's fc2 tiles and the wgmma path (K = T padded to 32)
@pytest.mark.parametrize("rows", [0, 1, 8, 9, 16, 17, 65, 255, 256, 300])
def test_timestep_mlp_plans_launch_what_the_hand_written_launcher_did(monkeypatch, fake_device, mlp_weights, arch,
                                                                      rows):
    monkeypatch.setattr(runtime, "arch_of", lambda device: arch)
    gen = torch.Generator().manual_seed(rows)
    x, grad = torch.randn((rows, FREQ), generator=gen), torch.randn((rows, TEMB), generator=gen)
    w1, b1, w2, b2 = mlp_weights.values()
    sm90 = arch == "sm_90a"
    # the launcher's overrides (speed only): its defaults, the wgmma paths forced either way, another config
    for config, wgmma in ((None, None), (None, True), (None, False), (timestep_mlp.WIDE_T, None)):
        calls = _same_run(monkeypatch, _old_mlp_forward, timestep_mlp.forward,
                          dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2), config, wgmma)
        weight_tile = forward_weight_tile("cpu", rows) if wgmma is None else \
            (forward_weight_tile("cpu", rows) or WEIGHT_TILE) if wgmma else None
        assert len(calls) == (0 if rows == 0 else 4 if weight_tile == WEIGHT_TILE else 3), [c[:2] for c in calls]
        if rows and (config, wgmma) == (None, None):
            assert (calls[-2][0] == "tf32x3_wgmma_weight_gemm") == (sm90 and (rows <= 16 or rows >= 256))
        calls = _same_run(monkeypatch, _old_mlp_backward, timestep_mlp.backward,
                          dict(grad=grad, x=x, w1=w1, b1=b1, w2=w2), config, wgmma)
        on_wgmma = uses_wgmma("cpu", rows) if wgmma is None else wgmma
        assert len(calls) == (0 if rows == 0 else 12 if on_wgmma else 8), [c[:2] for c in calls]


def test_timestep_mlp_plans_allocate_as_the_cpp_launcher_did(monkeypatch, fake_device):
    # One allocation for the output and one for the intermediates forward; one for the intermediates and one for
    # the five gradients backward; the regions packed in order, as the C++ launcher's Carver laid them out.
    for rows in (1, 9, 65, 300):
        for phase in P.Phase:
            plan = timestep_mlp.build(phase, "cpu", timestep_mlp.Key(), rows)
            regions, totals = P.carve(plan, rows)
            assert len(totals) == 2 - (phase is P.Phase.FORWARD)
            sizes = [0] * len(totals)
            for b in plan.buffers:
                if b.arena:
                    assert regions[b.name] == (plan.arenas().index(b.arena), sizes[regions[b.name][0]])
                    sizes[regions[b.name][0]] += P._numel(d(rows) for d in b.shape)
            assert sizes == totals
            allocations = []
            monkeypatch.setattr(torch, "empty", lambda *a, **kw: allocations.append(a) or _EMPTY(*a, **kw))
            P.allocate(plan, rows, "cpu")
            monkeypatch.setattr(torch, "empty", _EMPTY)
            assert len(allocations) == 2, (phase, rows, allocations)


def test_carved_regions_start_16_byte_aligned():
    shapes = [(3,), (P.M, 5), (2,)]
    buffers = tuple(P.Buffer(f"b{i}", torch.bfloat16, s, "a") for i, s in enumerate(shapes))
    buffers += (P.Buffer("c", torch.int64, (3,), "i"), P.Buffer("d", torch.int64, (P.M,), "i"))
    plan = P.Plan("op", P.Phase.FORWARD, None, 1, 9, (), buffers, (), ())
    regions, totals = P.carve(plan, 3)
    assert [regions[n] for n in ("b0", "b1", "b2", "c", "d")] == [(0, 0), (0, 8), (0, 24), (1, 0), (1, 4)]
    assert totals == [26, 7]
    buffers = P.allocate(plan, 3, "cpu")
    assert buffers["b1"].shape == (3, 5) and buffers["b1"].storage_offset() == 8
    assert buffers["b1"].untyped_storage().data_ptr() == buffers["b0"].untyped_storage().data_ptr()
    with pytest.raises(ValueError, match="mixes dtypes"):
        P.Plan("op", P.Phase.FORWARD, None, 1, 9, (), (P.Buffer("a", torch.float32, (4,), "x"),
                                                      P.Buffer("b", torch.int64, (4,), "x")), (), ())


def test_walks_worked_out_once_per_row_count_match_the_plan_at_every_row_count():
    # The walk keeps each plan's buffer geometry and strided views per row count (P._layout, the getters): a plan
    # walked at row counts in any order, past the number of row counts kept (the caches then start again), lays out
    # and views exactly what the plan says at each.
    strided = P.strided("b", (P.M, 2), (P.Dim(per_row=0, const=2), 1), P.Dim(per_row=1))
    plan = P.Plan("op", P.Phase.FORWARD, None, 0, 10_000, ("x",),
                  (P.Buffer("a", torch.float32, (P.M, 3), "arena"), P.Buffer("b", torch.float32, (P.Dim(per_row=3),),
                                                                             "arena"),
                   P.Buffer("c", torch.int64, (P.M,))),
                  (P.Launch(P.Kernel.of("k"), (P.view("x"), P.view("a"), strided, P.view("c"))),), ())
    seen = []
    fns = (lambda *args: seen.append(args),)
    counts = [5, 1, 5, *range(2, P._LAYOUTS_KEPT + 9), 5, 1]
    for rows in counts:
        x = torch.zeros(rows)
        P.walk(plan, fns, (x,), rows, (rows,), "cpu")
        _, a, b, c = seen[-1]
        regions, totals = P.carve(plan, rows)
        assert a.shape == (rows, 3) and a.stride() == (3, 1) and a.storage_offset() == regions["a"][1]
        assert a.untyped_storage().nbytes() == 4 * totals[0]
        assert b.shape == (rows, 2) and b.stride() == (2, 1), rows
        assert b.storage_offset() == regions["b"][1] + rows
        assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        assert c.shape == (rows,) and c.dtype == torch.int64 and c.untyped_storage().data_ptr() not in (
            a.untyped_storage().data_ptr(),)
    assert len(plan._layouts) <= P._LAYOUTS_KEPT
    for shape in ((), (0,), (3,), (0, 5), (4, 0, 2), (1, 7), (2, 3, 4)):
        assert P._contiguous_strides(shape) == torch.empty(shape).stride(), shape


@pytest.fixture(scope="module")
def projection_weights():
    # final_adaln_out's N (the block projection's 520 MB weight is walked on meta tensors in the C++ test)
    gen = torch.Generator().manual_seed(7)
    return (torch.randn((FINAL_PROJECTION, TEMB), generator=gen).bfloat16(),
            torch.randn((FINAL_PROJECTION,), generator=gen).bfloat16())


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])  # the wgmma family on sm_90a, the warp family on sm_100a
# T = 24 / 64 / 65: dW writes db to 64 (warp family: adaln_bias_grad beyond); 384 / 385: the wgmma dW folds beyond
@pytest.mark.parametrize("rows", [0, 1, 64, 65, 384, 385, 700])
def test_adaln_projection_plans_launch_what_the_hand_written_launcher_did(monkeypatch, fake_device, projection_weights,
                                                                          arch, rows):
    monkeypatch.setattr(runtime, "arch_of", lambda device: arch)
    monkeypatch.setattr(runtime, "sm_count", lambda device: adaln_projection.H200_SMS)
    gen = torch.Generator().manual_seed(rows)
    weight, bias = projection_weights
    temb = torch.randn((rows, TEMB), generator=gen)
    grad = torch.randn((rows, FINAL_PROJECTION), generator=gen).bfloat16()
    wgmma = arch == "sm_90a" and adaln_projection.SM90_FAMILY == "wgmma"
    family = "wgmma" if wgmma else "warp"
    for config in (None, adaln_projection.candidates("fwd", family)[-1]):  # the picks, and an explicit config
        calls = _same_run(monkeypatch, _old_projection_forward, adaln_projection.forward,
                          dict(temb=temb, weight=weight, bias=bias), config)
        assert [c[0] for c in calls] == (["adaln_silu_cast", "adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd"]
                                         if rows else [])
    wgrad = adaln_projection.wgrad_config_for_rows(max(rows, 1), wgmma, adaln_projection.H200_SMS)
    folds = adaln_projection.wgrad_folds(wgrad, wgmma)
    dgrad = adaln_projection.candidates("dgrad", family)[0]
    for config, fold_warps in ((None, None), (dgrad, None), (None, False)) + ((None, True),) * folds:
        calls = _same_run(monkeypatch, _old_projection_backward, adaln_projection.backward,
                          dict(grad=grad, temb=temb, weight=weight), config, fold_warps)
        names = [c[0] for c in calls]
        if rows == 0:
            assert names == []
        elif folds and fold_warps is not False:
            assert names[::2] == ["adaln_silu_cast", "adaln_proj_wgrad_fold"]
        else:
            assert names[1] == "adaln_dtemb_fold"
            assert ("adaln_bias_grad" in names) == (not adaln_projection.wgrad_writes_dbias(wgrad, rows))
    if rows and not folds:  # fold warps asked of a dW tile without them: the same refusal
        with pytest.raises(ValueError, match="has no fold warps"):
            adaln_projection.backward(grad, temb, weight, fold_warps=True)


def _final_part(phase, key, inputs, rows, lead, device):
    """A walk of final_adaln_out's plan part `key` (the C++ layer's int key) as h3_native.cpp walks it."""
    build, typed = final_adaln_out.part_plan(phase, key)
    return P.run(build, phase, typed, inputs, rows, lead, device)


def _cpp_final_forward(x, norm_weight, temb, proj_weight, proj_bias, ti, eps, check_indices):
    # h3_native.cpp final_adaln_out_fwd_cuda's walks: the projection's plan over T, then the norm rows' over S on
    # the projection's halves (Operand::columns)
    timesteps, rows = temb.shape[0], x.shape[0]
    proj = _final_part(P.Phase.FORWARD, (final_adaln_out.PROJECTION,), (temb, proj_weight, proj_bias), timesteps,
                       (timesteps,), x.device)[0]
    out = _final_part(P.Phase.FORWARD, (final_adaln_out.ROWS, int(check_indices)),
                      (x, norm_weight, proj[:, :HIDDEN], proj[:, HIDDEN:], ti, eps), rows, (rows,), x.device)[0]
    return out, proj


def _cpp_final_backward(grad, x, nw, temb, pw, pb, ti, eps, table=None):
    # h3_native.cpp final_adaln_out_backward_cuda's walks: the projection's forward plan where no table is given, the
    # norm rows' backward plan on its scale half, the projection's backward plan on the table gradient
    timesteps, rows, dev = temb.shape[0], x.shape[0], x.device
    projection = (final_adaln_out.PROJECTION,)
    if table is None:
        table = _final_part(P.Phase.FORWARD, projection, (temb, pw, pb), timesteps, (timesteps,), dev)[0]
    dx, dweight, dtable = _final_part(P.Phase.BACKWARD, (final_adaln_out.ROWS, timesteps),
                                      (grad, x, nw, table[:, HIDDEN:], ti, eps), rows, (rows,), dev)
    return (dx, dweight, *_final_part(P.Phase.BACKWARD, projection, (dtable, temb, pw), timesteps, (timesteps,), dev))


# every T to 30 (the fused norm backward's caps 12 and 24, unfused beyond; the projection's configs to 16 and 64) on
# sm_90a, the ends of those ranges on sm_100a (the warp family)
@pytest.mark.parametrize("arch, timesteps", [("sm_90a", t) for t in range(1, 31)] +
                         [("sm_100a", t) for t in (1, 12, 13, 16, 17, 24, 25, 30)])
def test_final_adaln_out_plans_launch_what_the_hand_written_launchers_did(monkeypatch, fake_device,
                                                                          projection_weights, arch, timesteps):
    # The Python launcher (its projection and norm rows, the oracles above) and h3_native.cpp's hand-written impls
    # (transcribed, T <= 24 backward; S >= 1) against the plan walks: the launcher's, and the C++ composition of
    # final_adaln_out's plan parts.
    monkeypatch.setattr(runtime, "arch_of", lambda device: arch)
    monkeypatch.setattr(runtime, "sm_count", lambda device: adaln_projection.H200_SMS)
    gen = torch.Generator().manual_seed(timesteps)
    weight, bias = projection_weights
    temb = torch.randn((timesteps, TEMB), generator=gen)
    nw = torch.randn((HIDDEN,), generator=gen).bfloat16()
    table = torch.randn((timesteps, FINAL_PROJECTION), generator=gen).bfloat16()
    # S = 0: no norm launch; the norm rows' plans serve every S >= 1 (norm_modulate's oracle runs each branch)
    ends = timesteps in (1, 12, 13, 24, 25, 30)
    for rows in (0, 7, 1031) if timesteps == 13 else (0, 7) if ends else (7,):
        x, grad = (torch.randn((rows, HIDDEN), generator=gen).bfloat16() for _ in range(2))
        ti = torch.randint(0, timesteps, (rows,), generator=gen)
        inputs = dict(x=x, norm_weight=nw, temb=temb, proj_weight=weight, proj_bias=bias, timestep_indices=ti)
        for check in (True, False):
            calls = _same_run(monkeypatch, _old_final_forward_with_table, final_adaln_out.forward_with_table, inputs,
                              1e-6, check)
            assert [c[0] for c in calls][2:] == (["norm_modulate_fwd"] if rows else [])
            if rows:
                assert _same_run(monkeypatch, _old_cpp_final_forward, _cpp_final_forward, inputs, 1e-6, check) == calls
        grads = dict(grad=grad, **inputs)
        for given in (None, table) if ends else (table,):  # None: the projection again, as the forward runs it
            calls = _same_run(monkeypatch, _old_final_backward, final_adaln_out.backward, grads, 1e-6, given)
            names = [c[0] for c in calls][0 if given is not None else 2:]
            fused = ["norm_modulate_bwd_fused", "rowwise_fold"] if timesteps <= 24 else \
                ["norm_modulate_bwd_rows", "norm_modulate_bwd_params", "rowwise_fold"]
            if rows:
                assert names[:len(fused)] == fused
            else:  # no norm launch: the table gradient zero-filled, the projection's backward on it
                assert not any(name.startswith("norm_modulate") for name in names) and "adaln_dtemb_fold" in names
            if rows and timesteps <= 24:
                assert _same_run(monkeypatch, _old_cpp_final_backward, _cpp_final_backward, grads, 1e-6, given) == calls
    with pytest.raises(ValueError, match="no plan part"):
        final_adaln_out.part_plan(P.Phase.FORWARD, (final_adaln_out.PROJECTION, 1))


def test_bind_gives_the_steps_the_walk_runs(fake_device):
    # plan.bind (the perf scripts' step list): the steps whose guard holds, in order, with the arguments the walk
    # passes (fills as their targets), on the inputs and buffers it returns by name.
    def geometry(args):
        return [(tuple(a.shape), a.stride(), a.storage_offset()) if isinstance(a, torch.Tensor) else a for a in args]

    cases = [(timestep_mlp.build(P.Phase.BACKWARD, "cpu", timestep_mlp.Key(wgmma=True), 40), 40)]
    cases += [(linear.build(P.Phase.BACKWARD, "cpu", linear.BackwardKey(5376, 96, True), rows), rows)
              for rows in (300, 512)]  # the tail GEMM, and the fill in its place
    for plan, rows in cases:
        inputs = [torch.empty_strided(sizes, strides, dtype=dtype, device="meta")
                  for sizes, strides, dtype in _plan_inputs(plan, rows)]
        walked = []
        fns = tuple((lambda i: lambda *args: walked.append((plan.kernels()[i], geometry(args))))(i)
                    for i in range(len(plan.kernels())))
        P.walk(plan, fns, inputs, rows, (rows,), "meta")
        env, bound = P.bind(plan, inputs, rows, "meta")
        assert set(env) == {*plan.inputs, *(b.name for b in plan.buffers)}
        launches = [(step.kernel, geometry(args)) for step, args in bound if isinstance(step, P.Launch)]
        assert launches == walked and len(walked) > 2
        fills = [step for step, _ in bound if isinstance(step, P.Fill)]
        assert len(fills) == (rows == 512), (rows, fills)


# ---- plans are data ------------------------------------------------------------------------------------------


def _plans(device="cpu"):
    """Every plan of the ops on plans over their row ranges (a few row counts per range)."""
    out = []
    for n, k in LINEAR_SHAPES:
        for rows in (0, 1, 255, 256, 257, 4097):
            for flag in (True, False):
                out.append(linear.build(P.Phase.FORWARD, device, linear.ForwardKey(n, k, flag), rows))
                out.append(linear.build(P.Phase.BACKWARD, device, linear.BackwardKey(n, k, flag), rows))
    for rows in (0, 1, 8, 9, 16, 17, 64, 65, 255, 256, 300, 4097):
        for key in (timestep_mlp.Key(), timestep_mlp.Key(wgmma=True), timestep_mlp.Key(wgmma=False)):
            for phase in P.Phase:
                out.append(timestep_mlp.build(phase, device, key, rows))
    for n in (BLOCK_PROJECTION, FINAL_PROJECTION):
        for rows in (0, 1, 24, 64, 65, 384, 385, 700, 4097):
            out.append(adaln_projection.build(P.Phase.FORWARD, device, adaln_projection.ForwardKey(n), rows))
            out.append(adaln_projection.build(P.Phase.BACKWARD, device, adaln_projection.BackwardKey(n), rows))
        out.append(adaln_projection.build(P.Phase.BACKWARD, device, adaln_projection.BackwardKey(n, fold_warps=False),
                                          700))
    for rows in (0, 1, 1031):
        for check in (True, False):
            out.append(gate_residual.build(P.Phase.FORWARD, device, gate_residual.ForwardKey(HIDDEN, check), rows))
            out.append(norm_modulate.build(P.Phase.FORWARD, device, norm_modulate.ForwardKey(HIDDEN, check), rows))
        out.append(norm_modulate.build(P.Phase.FORWARD, device,
                                       norm_modulate.ForwardKey(HIDDEN, True, "final_adaln_out", "timestep_indices"),
                                       rows))
        for check in (True, False):
            out.append(gate_residual_norm_modulate.build(P.Phase.FORWARD, device,
                                                         gate_residual_norm_modulate.ForwardKey(HIDDEN, check), rows))
            out.append(adaln_row_gather.build(P.Phase.FORWARD, device, adaln_row_gather.ForwardKey(HIDDEN, check),
                                              rows))
            out.append(timestep_sinusoid.build(P.Phase.FORWARD, device, timestep_sinusoid.ForwardKey(check), rows))
        for table_rows in (0, 3, 48, 49, 150):
            out.append(adaln_row_gather.build(P.Phase.BACKWARD, device,
                                              adaln_row_gather.BackwardKey(HIDDEN, table_rows), rows))
        for table_rows in (3, 24, 48, 49, 150):
            out.append(gate_residual.build(P.Phase.BACKWARD, device,
                                           gate_residual.BackwardKey(HIDDEN, table_rows), rows))
            for table_grad in (False, True):
                out.append(norm_modulate.build(P.Phase.BACKWARD, device,
                                               norm_modulate.BackwardKey(HIDDEN, table_rows, table_grad), rows))
    # final_adaln_out's plan parts, as its native_plan serves them to the C++ layer (C++ backward: T <= 24)
    final = final_adaln_out
    parts = [(phase, (final.PROJECTION,), t) for phase in P.Phase for t in (1, 16, 17, 24, 65)]
    parts += [(P.Phase.FORWARD, (final.ROWS, check), rows) for check in (0, 1) for rows in (0, 1, 1031)]
    parts += [(P.Phase.BACKWARD, (final.ROWS, t), rows) for t in (1, 12, 13, 24) for rows in (0, 1, 1031)]
    for phase, key, rows in parts:
        build, typed = final.part_plan(phase, key)
        out.append(build(phase, device, typed, rows))
    return out


BUILDERS = {"linear": linear.build, "gate_residual": gate_residual.build, "norm_modulate": norm_modulate.build,
            "gate_residual_norm_modulate": gate_residual_norm_modulate.build,
            "adaln_row_gather": adaln_row_gather.build, "timestep_sinusoid": timestep_sinusoid.build,
            "timestep_mlp": timestep_mlp.build, "adaln_projection": adaln_projection.build}


def test_each_plan_serves_its_whole_row_range(fake_device):
    # A plan is cached for [lo, hi]: the builder gives the same plan at both ends of the range and inside it.
    for plan in _plans():
        for rows in {plan.lo, min(plan.hi, plan.lo + 1), min(plan.hi, 10**6), plan.hi}:
            assert BUILDERS[plan.op](plan.phase, "cpu", plan.key, rows) == plan, (str(plan), rows)


def test_linear_backward_plan_reads_as_a_list(fake_device):
    plan = linear.build(P.Phase.BACKWARD, "cpu", linear.BackwardKey(5376, 96, True), 300)
    text = str(plan)
    assert text.splitlines()[0] == ("linear backward BackwardKey(out_features=5376, in_features=96, x_grad=True) "
                                    "rows [256, MAX]")
    lines = [line.strip() for line in text.splitlines()]
    assert "buffer partials: f32 (9, 5376, 96)" in lines
    assert any(line.endswith("(grad[M//256*256:M].t, x[M//256*256:M].t, partials[8:9])  if M - M//256*256 != 0")
               for line in lines), text
    assert "fill partials[8:9] = 0.0  if M - M//256*256 == 0" in lines
    assert lines[-3:] == ["-> dx as rows", "-> dweight", "-> sum0(grad)"]


def test_dims_are_the_row_terms_the_plans_use():
    bulk = P.whole_rows(256)
    tail = P.M - bulk
    assert [bulk(m) for m in (0, 255, 256, 257, 4097)] == [0, 0, 256, 256, 4096]
    assert [tail(m) for m in (0, 255, 256, 257, 4097)] == [0, 255, 0, 1, 1]
    assert str(tail) == "M - M//256*256" and str(P.dim(9)) == "9" and str(P.M + 3) == "M + 3"
    with pytest.raises(ValueError, match="mixes row steps"):
        bulk + P.whole_rows(128)
    padded = P.rows_up(32)
    assert [padded(m) for m in (0, 1, 31, 32, 33, 300)] == [0, 32, 32, 32, 64, 320]
    assert str(padded) == "ceil(M/32)*32" and str(padded - P.M) == "-M + ceil(M/32)*32"
    blocks = P.row_blocks(64)
    assert [blocks(m) for m in (0, 1, 64, 65, 385)] == [0, 1, 1, 2, 7] and str(blocks) == "ceil(M/64)"
    for other in (P.whole_rows(32), blocks):
        with pytest.raises(ValueError, match="mixes row steps"):
            padded + other


def test_encoding_is_ints_in_the_documented_order(fake_device):
    for plan in _plans():
        handles = list(range(7, 7 + len(plan.kernels())))
        lo, hi, inputs, hs, buffers, steps, outputs = P.encode(plan, handles)
        assert (lo, hi, inputs, hs) == (plan.lo, plan.hi, len(plan.inputs), tuple(handles))
        assert len(buffers) == len(plan.buffers) and len(steps) == len(plan.steps)
        assert len(outputs) == len(plan.outputs)
        for (kind, kernel, value, cond, args), step in zip(steps, plan.steps, strict=True):
            assert kind == isinstance(step, P.Fill) and cond[0] == (step.when is not None)
            if kind == 0:
                assert plan.kernels()[kernel] == step.kernel and len(args) == len(step.args)


# ---- the C++ layer decodes and walks the same plans (called by tests/test_native.py's build test) ---------------


def _plan_inputs(plan, rows):
    """(sizes, strides, dtype) of fresh inputs of `plan` for `rows` rows (tables row-strided, as read in place), and
    a float for each float input."""
    f32, bf16, i64 = torch.float32, torch.bfloat16, torch.int64
    if plan.op in ("linear", "timestep_mlp"):
        n, k = (plan.key.out_features, plan.key.in_features) if plan.op == "linear" else (TEMB, FREQ)
        shapes = dict(x=((rows, k), f32), grad=((rows, n), f32), weight=((n, k), f32), bias=((n,), f32),
                      w1=((MLP_HIDDEN, FREQ), f32), b1=((MLP_HIDDEN,), f32), w2=((TEMB, MLP_HIDDEN), f32),
                      b2=((TEMB,), f32))
        return [(shape, torch.empty(shape).stride(), dtype) for shape, dtype in (shapes[i] for i in plan.inputs)]
    if plan.op == "adaln_projection":
        n = plan.key.out_features
        shapes = dict(temb=((rows, TEMB), f32), grad=((rows, n), bf16), weight=((n, TEMB), bf16), bias=((n,), bf16))
        return [(shape, torch.empty(shape, device="meta").stride(), dtype)
                for shape, dtype in (shapes[i] for i in plan.inputs)]
    table_rows = getattr(plan.key, "table_rows", 9)
    table = ((table_rows, HIDDEN), (2 * HIDDEN, 1), bf16)
    geometry = {"adaln_indices": ((rows,), (1,), i64), "gate": table, "shift": table, "scale": table,
                "weight": ((HIDDEN,), (1,), bf16), "eps": 1e-6,
                "table": ((table_rows, BLOCK_TABLE), (BLOCK_TABLE + 8, 1), bf16), "t": ((rows,), (1,), f32)}
    return [geometry.get(name, ((rows, HIDDEN), (HIDDEN, 1), bf16)) for name in plan.inputs]


def _python_walk(plan, rows, lead, monkeypatch):
    """The Python walker's launches on meta inputs, in describe_walk's format: [(kernel index, [(0, int) |
    (1, (source, offset, sizes, strides))])], and [(sizes, strides)] of the outputs; sources index the inputs, then
    the buffers, and offsets count from the source's allocation (its arena's for a carved buffer)."""
    inputs = [g if isinstance(g, float) else torch.empty_strided(g[0], g[1], dtype=g[2], device="meta")
              for g in _plan_inputs(plan, rows)]
    # (allocation, source, start, elements) of the tensor inputs and the buffers
    sources = [(t, i, 0, _span(t)) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]

    def allocate(*args):
        buffers = _ALLOCATE(*args)
        for i, b in enumerate(plan.buffers):
            t = buffers[b.name]
            sources.append((t if t._base is None else t._base, len(inputs) + i, t.storage_offset(), t.numel()))
        return buffers

    monkeypatch.setattr(P, "allocate", allocate)
    launches = []

    def geometry(a):
        if isinstance(a, float):
            return (2, a)
        if not isinstance(a, torch.Tensor):
            return (0, a)
        root, offset = a if a._base is None else a._base, a.storage_offset()
        # the smallest region of a's allocation that holds it (a carved buffer, not its arena's others)
        source = min((numel, i) for t, i, start, numel in sources
                     if t is root and start <= offset and offset + _span(a) <= start + numel)[1]
        return (1, (source, offset, tuple(a.shape), a.stride()))

    def kernel(index):
        return lambda *args: launches.append((index, tuple(geometry(a) for a in args)))

    fns = tuple(kernel(i) for i in range(len(plan.kernels())))
    outputs = P.walk(plan, fns, inputs, rows, lead, "meta")
    monkeypatch.setattr(P, "allocate", _ALLOCATE)
    return tuple(launches), tuple((tuple(t.shape), t.stride()) for t in outputs)


def assert_cpp_walks_the_plans(module, monkeypatch):
    """`module` (the built h3cute_native): each plan of the ops on plans decodes to itself (describe_plan), and the C++
    walk of it (describe_walk) launches the same kernels with the same argument geometry (source, offset, sizes,
    strides) and makes outputs of the same geometry as the Python walker, at several row counts of its range."""
    monkeypatch.setattr(runtime, "arch_of", lambda device: "sm_90a")
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)
    monkeypatch.setattr(checks, "slot_addresses",
                        lambda device, op, arg, checked=True: (11, 12) if checked else (13, 14))
    codes = {torch.float32: 0, torch.bfloat16: 1, torch.int64: 2}
    walked = 0
    for plan in _plans():
        encoded = P.encode(plan, list(range(100, 100 + len(plan.kernels()))))
        assert repr(module.describe_plan(encoded)) == repr(encoded), str(plan)
        for rows in sorted({plan.lo, plan.lo + 1, 512, 4097, 4098} & set(range(plan.lo, min(plan.hi, 5000) + 1))):
            lead = (2, rows // 2) if plan.op == "linear" and rows % 2 == 0 else (rows,)
            inputs = [g if isinstance(g, float) else (list(g[0]), list(g[1]), codes[g[2]])
                      for g in _plan_inputs(plan, rows)]
            got = module.describe_walk(encoded, rows, inputs, list(lead))
            assert got == _python_walk(plan, rows, lead, monkeypatch), (str(plan), rows)
            walked += 1
    assert walked > 100


def test_native_plan_takes_the_cpp_int_keys(monkeypatch, fake_device):
    # h3_native.cpp passes (phase name, key ints): the plan is the one the Python launcher builds for the typed key.
    monkeypatch.setattr(runtime, "kernel", _Recorder({}))
    encoded = linear.native_plan(0, "backward", (5376, 96, 1), 300)
    plan, fns = P.plan_for(linear.build, P.Phase.BACKWARD, torch.device("cuda", 0), linear.BackwardKey(5376, 96, True),
                           300)
    assert plan.key.x_grad is True and encoded == P.encode(plan, [fn.__chandle__() for fn in fns])
    lo, hi, inputs, handles = gate_residual.native_plan(0, "forward", (HIDDEN, 0), 5)[:4]
    assert (lo, hi, inputs, len(handles)) == (1, runtime.MAX_ROWS, 4, 1)
    # a key's later fields keep their defaults: h3::norm_modulate's own check slot, its gradients' table layout
    for phase, ints, key in (("forward", (HIDDEN, 1), norm_modulate.ForwardKey(HIDDEN, True)),
                             ("backward", (HIDDEN, 9, 0), norm_modulate.BackwardKey(HIDDEN, 9, False))):
        encoded = norm_modulate.native_plan(0, phase, ints, 5)
        plan, fns = P.plan_for(norm_modulate.build, P.Phase(phase), torch.device("cuda", 0), key, 5)
        assert encoded == P.encode(plan, [fn.__chandle__() for fn in fns])
        assert len(plan.outputs) == (1 if phase == "forward" else 4)  # out; dx, dweight, dshift, dscale
    encoded = gate_residual_norm_modulate.native_plan(0, "forward", (HIDDEN, 1), 5)
    slot = checks.slot_addresses(0, "gate_residual_norm_modulate", "adaln_indices")
    assert len(encoded[3]) == 1 and encoded[5][0][4][-2:] == tuple((0, a) for a in slot)  # its check slot, vec 4
    assert P.plan_for(gate_residual_norm_modulate.build, P.Phase.FORWARD, torch.device("cuda", 0),
                      gate_residual_norm_modulate.ForwardKey(HIDDEN, True), 5)[0].kernels()[0].static[-1] == ("vec", 4)
    # final_adaln_out's parts: the plans its Python launcher walks (adaln_projection.forward / backward of its weight,
    # norm_modulate.forward_rows with its check slot, backward_rows with table_grad), the same cached entries
    final = final_adaln_out
    monkeypatch.setattr(P, "_cache", {})
    for phase, ints, rows, build, key in (
            ("forward", (final.PROJECTION,), 3, adaln_projection.build, adaln_projection.ForwardKey(FINAL_PROJECTION)),
            ("backward", (final.PROJECTION,), 3, adaln_projection.build,
             adaln_projection.BackwardKey(FINAL_PROJECTION)),
            ("forward", (final.ROWS, 0), 5, norm_modulate.build,
             norm_modulate.ForwardKey(HIDDEN, False, "final_adaln_out", "timestep_indices")),
            ("backward", (final.ROWS, 9), 5, norm_modulate.build, norm_modulate.BackwardKey(HIDDEN, 9, True))):
        encoded = final.native_plan(0, phase, ints, rows)
        cached = sum(map(len, P._cache.values()))
        plan, fns = P.plan_for(build, P.Phase(phase), torch.device("cuda", 0), key, rows)
        assert encoded == P.encode(plan, [fn.__chandle__() for fn in fns]), (phase, ints)
        assert sum(map(len, P._cache.values())) == cached  # the plan native_plan cached
    slot = checks.slot_addresses(0, "final_adaln_out", "timestep_indices", False)
    assert final.native_plan(0, "forward", (final.ROWS, 0), 5)[5][0][4][-2:] == tuple((0, a) for a in slot)
    with pytest.raises(ValueError):
        linear.native_plan(0, "sideways", (5376, 96, 1), 300)
