"""MiniMax-H3's widths and the ops' contract constants, written once.

The checkpoint fixes them (diffusers' `MiniMaxH3Transformer3DModel` argument names in brackets): h3cute serves
exactly these widths and refuses others, so they are contract constants, not tuning knobs. Everything reads them
from here: the kernels at compile time (this file is part of the kernels' source fingerprint, so an edit here
recompiles them), the launchers, the op checks and references, the C++ op layer (handed them at load by
`h3cute.native.install`), the benchmarks, perf scripts and tests. Pure Python: no torch, no cutlass.
"""

# ---- the conditioning path h3cute computes ----
HIDDEN = 5376  # H [hidden_size]: the width of the rows the norm, modulate and gate ops read and write
FREQ = 256  # F1 [freq_dim]: time_proj's sinusoid channels, the time MLP's in_features
FREQ_HALF = FREQ // 2  # the sinusoid's cos | sin halves, one frequency per channel pair
MAX_PERIOD = 10000  # time_proj's max_period: frequency k is exp(-ln(MAX_PERIOD) k / FREQ_HALF)
MLP_HIDDEN = 5376  # [time_embed_hidden_dim]: the time MLP's linear_1 out_features, linear_2 in_features
TEMB = 2688  # D [time_embed_dim]: the time embedding, K of every AdaLN projection
MODALITIES = 3  # [MINIMAX_H3_MODALITY_NUM] token tags: 3 table rows per timestep, adaln_indices = ti * 3 + tag
BLOCK_CHUNKS = 6  # shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp: a block's modulation chunks
BLOCK_TABLE = BLOCK_CHUNKS * HIDDEN  # 32256: one row of a block's (3T, 6H) modulation table
BLOCK_PROJECTION = MODALITIES * BLOCK_TABLE  # 96768 = 18H: a block's adaln_projection out_features (3 table rows)
FINAL_PROJECTION = 2 * HIDDEN  # 10752: norm_out's projection out_features, shift | scale
NORM_EPS = 1e-5  # [norm_eps, final_norm_eps]: the RMSNorm eps, the default of the norm ops' `eps`

# ---- the rest of the transformer (diffusers computes it; the model benchmark builds it at these widths) ----
ATTENTION_HEADS = 56  # [num_attention_heads]
ATTENTION_HEAD_DIM = 128  # [attention_head_dim]: heads x head_dim = 7168 attention channels
ROPE_FREQ_DIM = 16  # [rope_freq_dim]: frequencies per (t, h, w) axis
ROTARY_DIM = 2 * 3 * ROPE_FREQ_DIM  # 96: the leading channels of each head the rope rotates (rotate_half)
FFN = 14336  # [ffn_dim]: the SwiGLU feed-forward's inner width
TEXT = 5120  # [text_dim]: the text encoder's width, context_embedder's in_features

# ---- the FP32 input and output heads (h3::linear): hidden <-> latent patches ----
VIDEO_PATCH = 96  # [in_channels * prod(patch_size)] = 24 * (1 * 2 * 2): proj_in's in_features, proj_out's out_features
AUDIO_CHANNELS = 32  # [audio_in_channels]: audio_proj_in's in_features, audio_proj_out's out_features
# the FP32 heads' (out_features, in_features) by module name: the weights h3::linear serves
FP32_HEADS = {"proj_in": (HIDDEN, VIDEO_PATCH), "audio_proj_in": (HIDDEN, AUDIO_CHANNELS),
              "proj_out": (VIDEO_PATCH, HIDDEN), "audio_proj_out": (AUDIO_CHANNELS, HIDDEN)}
LINEAR_SHAPES = tuple(FP32_HEADS.values())
