"""Image and text towers, built with open_clip's own builders and then adapted. DESIGN §2.2.

Adaptations, each done by swapping a submodule or parameter of the open_clip tower (no transformer
block is re-implemented here):
- `final_ln: false` (EuCLIP) replaces `ln_post` / `ln_final` with `nn.Identity`; `ln_pre: false`
  (open_clip's `no_ln_pre`) and `patch_bias: true` reproduce MERU's timm ViT.
- `pos_embed: sincos` (MERU) overwrites the ViT's `positional_embedding` with a frozen 2-D sin-cos
  table in MERU's (MoCo-v3) layout, class-token rows zero.
- Multi-token oblique towers (`MultiTokenVisionTower`, `MultiTokenTextTower`) give each tower one class
  token per sphere; each token is projected by the tower's shared projection to sphere_dim and the
  results are concatenated, so the geometry then normalizes sphere by sphere.
"""

from __future__ import annotations

import torch
from open_clip.model import CLIPTextCfg, CLIPVisionCfg, _build_text_tower, _build_vision_tower
from open_clip.transformer import TextTransformer, VisionTransformer
from torch import nn

from hype.models.config import ModelConfig, TextConfig, VisionConfig

Tensor = torch.Tensor

_DEFAULT_LN_EPS = 1e-5


def sincos_2d_table(width: int, grid_size: int, num_prefix_tokens: int = 1) -> Tensor:
    """Fixed 2-D sin-cos position table of MERU / MoCo-v3, shape (num_prefix + grid², width).

    Patch m = (row r, column c) gets [sin(r ω), cos(r ω), sin(c ω), cos(c ω)] with
    ω_d = 10000^(-d / (width/4)); the prefix (class token) rows are zero. This is numerically the
    table MERU's `build_timm_vit` writes, so MERU checkpoints and ours agree on the frozen rows.
    """
    if width % 4:
        raise ValueError(f"sin-cos position embedding needs width divisible by 4, got {width}")
    quarter = width // 4
    omega = 1.0 / (10000.0 ** (torch.arange(quarter, dtype=torch.float32) / quarter))
    coords = torch.arange(grid_size, dtype=torch.float32)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    out_r = rows.flatten()[:, None] * omega[None, :]
    out_c = cols.flatten()[:, None] * omega[None, :]
    table = torch.cat([out_r.sin(), out_r.cos(), out_c.sin(), out_c.cos()], dim=1)
    return torch.cat([torch.zeros(num_prefix_tokens, width), table], dim=0)


def _norm_kwargs(eps: float) -> dict | None:
    # Only pass a norm override when it changes something, so default towers are module-for-module
    # identical to open_clip's.
    return None if eps == _DEFAULT_LN_EPS else {"eps": eps}


def open_clip_vision_cfg(cfg: VisionConfig) -> CLIPVisionCfg:
    return CLIPVisionCfg(
        layers=cfg.layers,
        width=cfg.width,
        head_width=cfg.head_width,
        mlp_ratio=cfg.mlp_ratio,
        patch_size=cfg.patch_size,
        image_size=cfg.image_size,
        no_ln_pre=not cfg.ln_pre,
        norm_kwargs=_norm_kwargs(cfg.ln_eps),
    )


def open_clip_text_cfg(cfg: TextConfig) -> CLIPTextCfg:
    return CLIPTextCfg(
        context_length=cfg.context_length,
        vocab_size=cfg.vocab_size,
        width=cfg.width,
        heads=cfg.heads,
        layers=cfg.layers,
        mlp_ratio=cfg.mlp_ratio,
        norm_kwargs=_norm_kwargs(cfg.ln_eps),
    )


class MultiTokenVisionTower(nn.Module):
    """ViT with k class tokens prepended to the patch tokens; output (B, k * sphere_dim).

    The wrapped open_clip tower's `class_embedding` becomes (k, width), randomly initialized like
    open_clip's single token (std width^-0.5) so the k tokens start different, and its
    `positional_embedding` grows to (k + grid², width). Its own `forward` no longer applies; this
    module's `forward` reuses its submodules (conv1, ln_pre, transformer, ln_post, proj).
    """

    def __init__(self, tower: VisionTransformer, num_tokens: int, sincos: bool):
        super().__init__()
        if not isinstance(tower.patch_dropout, nn.Identity):
            raise ValueError("patch dropout would drop class tokens of a multi-token tower")
        width = tower.class_embedding.shape[-1]
        num_patches = tower.grid_size[0] * tower.grid_size[1]
        scale = width**-0.5
        tower.class_embedding = nn.Parameter(scale * torch.randn(num_tokens, width))
        if sincos:
            table = sincos_2d_table(width, tower.grid_size[0], num_tokens)
            tower.positional_embedding = nn.Parameter(table, requires_grad=False)
        else:
            tower.positional_embedding = nn.Parameter(scale * torch.randn(num_tokens + num_patches, width))
        self.num_tokens = num_tokens
        self.tower = tower

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.tower.set_grad_checkpointing(enable)

    def forward(self, images: Tensor) -> Tensor:
        t = self.tower
        x = t.conv1(images)  # (B, width, grid, grid)
        x = x.flatten(2).transpose(1, 2)  # (B, grid², width)
        cls = t.class_embedding.to(x.dtype).unsqueeze(0).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + t.positional_embedding.to(x.dtype)
        x = t.transformer(t.ln_pre(x))
        x = t.ln_post(x[:, : self.num_tokens])  # LayerNorm is per token: slicing first is equivalent
        return (x @ t.proj).flatten(1)  # shared projection to sphere_dim, spheres concatenated


class MultiTokenTextTower(nn.Module):
    """Causal text transformer with k class tokens appended after the text; output (B, k * sphere_dim).

    The oblique paper prepends k CLS tokens to a bidirectional BERT. open_clip's text tower is causal
    and pools at EOT, so prepended tokens would see no text. Instead the k class tokens go after the
    context_length text positions, each with its own learned position; they attend to every class token
    and to the real text (positions up to and including EOT; padding keys are masked), while text
    tokens keep their causal mask and never see the class tokens. The text part of the computation is
    therefore exactly the single-token tower's.
    """

    def __init__(self, tower: TextTransformer, num_tokens: int):
        super().__init__()
        width, ctx = tower.width, tower.context_length
        self.class_embedding = nn.Parameter(width**-0.5 * torch.randn(num_tokens, width))
        extra_pos = torch.empty(num_tokens, width, device=tower.positional_embedding.device)
        nn.init.normal_(extra_pos, std=0.01)  # open_clip's init of text positions
        tower.positional_embedding = nn.Parameter(torch.cat([tower.positional_embedding.data, extra_pos]))
        self.num_tokens = num_tokens
        self.context_length = ctx
        self.tower = tower

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.tower.set_grad_checkpointing(enable)

    def attention_mask(self, tokens: Tensor, dtype: torch.dtype) -> Tensor:
        """Additive mask (B * heads, L + k, L + k) for text of length L followed by k class tokens."""
        B, L = tokens.shape
        k, device = self.num_tokens, tokens.device
        pos = torch.arange(L + k, device=device)
        allowed = (pos[None, :] <= pos[:, None]).expand(B, -1, -1).clone()  # causal among text
        allowed[:, :L, L:] = False  # text never sees class tokens
        eot = tokens.argmax(dim=-1)  # EOT has the highest id, as in open_clip's pooling
        real = pos[None, :L] <= eot[:, None]  # (B, L): keys up to EOT are text, the rest padding
        allowed[:, L:, :L] = real[:, None, :]
        allowed[:, L:, L:] = True
        mask = torch.zeros(B, L + k, L + k, dtype=dtype, device=device)
        mask.masked_fill_(~allowed, float("-inf"))
        return mask.repeat_interleave(self.tower.heads, dim=0)

    def forward(self, tokens: Tensor) -> Tensor:
        t = self.tower
        L = tokens.shape[1]
        if L > self.context_length:
            raise ValueError(f"tokens have length {L} > context_length {self.context_length}")
        cast_dtype = t.transformer.get_cast_dtype()
        x = t.token_embedding(tokens).to(cast_dtype)
        cls = self.class_embedding.to(cast_dtype).unsqueeze(0).expand(x.shape[0], -1, -1)
        x = torch.cat([x, cls], dim=1)
        pos = torch.cat([t.positional_embedding[:L], t.positional_embedding[self.context_length :]])
        x = x + pos.to(cast_dtype)
        x = t.transformer(x, attn_mask=self.attention_mask(tokens, x.dtype))
        x = t.ln_final(x[:, L:])
        return (x @ t.text_projection).flatten(1)


def build_image_tower(config: ModelConfig) -> nn.Module:
    """open_clip ViT for `config`: images (B, 3, H, W) -> projected features (B, embed_dim)."""
    cfg, k = config.vision, config.num_class_tokens
    out_dim = config.embed_dim // k
    tower = _build_vision_tower(out_dim, open_clip_vision_cfg(cfg), quick_gelu=config.quick_gelu)
    if not cfg.final_ln:
        tower.ln_post = nn.Identity()
    if cfg.patch_bias:
        tower.conv1 = nn.Conv2d(3, cfg.width, cfg.patch_size, stride=cfg.patch_size, bias=True)
    if k > 1:
        return MultiTokenVisionTower(tower, k, sincos=cfg.pos_embed == "sincos")
    if cfg.pos_embed == "sincos":
        table = sincos_2d_table(cfg.width, cfg.grid_size, 1)
        tower.positional_embedding = nn.Parameter(table, requires_grad=False)
    return tower


def build_text_tower(config: ModelConfig) -> nn.Module:
    """open_clip causal text transformer: tokens (B, L) -> projected features (B, embed_dim)."""
    cfg, k = config.text, config.num_class_tokens
    out_dim = config.embed_dim // k
    tower = _build_text_tower(out_dim, open_clip_text_cfg(cfg), quick_gelu=config.quick_gelu)
    if not cfg.final_ln:
        tower.ln_final = nn.Identity()
    if k > 1:
        return MultiTokenTextTower(tower, k)
    return tower
