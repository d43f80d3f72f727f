"""transformers' contrastive models from tiny configs (random weights, nothing downloaded),
and a batch of inputs for each: tests/integrations/transformers/test_contrastive.py runs them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

Inputs = Callable[[int], dict[str, Any]]

_BLOCK = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2)
_TEXT = dict(vocab_size=99, max_position_embeddings=32, bos_token_id=0, eos_token_id=2,
             pad_token_id=1, **_BLOCK)
_VISION = dict(image_size=16, patch_size=8, **_BLOCK)


def texts(n: int, length: int = 6) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {"input_ids": torch.randint(3, 99, (n, length), generator=g)}


def images(n: int, size: int = 16) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 + n)
    return {"pixel_values": torch.randn(n, 3, size, size, generator=g)}


def _both(size: int = 16) -> Inputs:
    return lambda n: {**texts(n), **images(n, size)}


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    model = make().eval()
    # Scales and biases away from their initial values, so a recipe that drops one (or
    # uses another's) gives other logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "." not in name and p.numel() == 1:
                p.add_(torch.rand(()) * 0.5 + 0.25)
    return model


def _text_vision(config: type, model: type, **options: Any) -> tuple[nn.Module, Inputs]:
    """``model`` of ``config`` over the tiny text and vision blocks, and its text-and-image inputs."""
    built = config(text_config=_TEXT, vision_config=_VISION, **options)
    return _seeded(lambda: model(built)), _both()


def clip(cls: type | None = None) -> tuple[nn.Module, Inputs]:
    """A CLIPModel, or the subclass ``cls`` of it (a user's own CLIP), and its inputs."""
    return _text_vision(transformers.CLIPConfig, cls or transformers.CLIPModel, projection_dim=16)


def siglip() -> tuple[nn.Module, Inputs]:
    return _text_vision(transformers.SiglipConfig, transformers.SiglipModel)


def siglip2() -> tuple[nn.Module, Inputs]:
    config = transformers.Siglip2Config(text_config=_TEXT, vision_config=dict(patch_size=8, num_patches=4, **_BLOCK))

    def inputs(n: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(100 + n)
        return {**texts(n), "pixel_values": torch.randn(n, 4, 3 * 8 * 8, generator=g),
                "pixel_attention_mask": torch.ones(n, 4, dtype=torch.long),
                "spatial_shapes": torch.tensor([[2, 2]] * n)}

    return _seeded(lambda: transformers.Siglip2Model(config)), inputs


def align() -> tuple[nn.Module, Inputs]:
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                num_hidden_layers=2, max_position_embeddings=32)
    vision = dict(image_size=32, num_channels=3, hidden_dim=32, width_coefficient=0.1,
                  depth_coefficient=0.1, initializer_range=0.4)  # activations neither vanish nor blow up
    config = transformers.AlignConfig(text_config=text, vision_config=vision, projection_dim=32)
    return _seeded(lambda: transformers.AlignModel(config)), _both(32)


def clap() -> tuple[nn.Module, Inputs]:
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                num_hidden_layers=2, max_position_embeddings=40, projection_dim=16)
    audio = dict(window_size=4, num_mel_bins=16, spec_size=32, patch_size=4, patch_stride=4,
                 hidden_size=32, projection_dim=16, depths=[1, 1], num_attention_heads=[2, 2],
                 patch_embeds_hidden_size=16, enable_fusion=False)
    config = transformers.ClapConfig(text_config=text, audio_config=audio, projection_dim=16)

    def inputs(n: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(100 + n)
        return {**texts(n), "input_features": torch.randn(n, 1, 32, 16, generator=g)}

    return _seeded(lambda: transformers.ClapModel(config)), inputs


def chinese_clip() -> tuple[nn.Module, Inputs]:
    return _text_vision(transformers.ChineseCLIPConfig, transformers.ChineseCLIPModel, projection_dim=16)


def altclip() -> tuple[nn.Module, Inputs]:
    text = dict(project_dim=16, **_TEXT)
    config = transformers.AltCLIPConfig(text_config=text, vision_config=_VISION, projection_dim=16)
    return _seeded(lambda: transformers.AltCLIPModel(config)), _both()


def groupvit() -> tuple[nn.Module, Inputs]:
    vision = dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=37,
                  num_attention_heads=4, depths=[1, 1], num_group_tokens=[4, 2],
                  num_output_groups=[4, 2], num_hidden_layers=2)
    config = transformers.GroupViTConfig(text_config=_TEXT, vision_config=vision, projection_dim=16,
                                         projection_intermediate_dim=16)
    return _seeded(lambda: transformers.GroupViTModel(config)), _both()


def owlvit() -> tuple[nn.Module, Inputs]:
    return _text_vision(transformers.OwlViTConfig, transformers.OwlViTModel, projection_dim=16)


def owlv2() -> tuple[nn.Module, Inputs]:
    return _text_vision(transformers.Owlv2Config, transformers.Owlv2Model, projection_dim=16)


def blip() -> tuple[nn.Module, Inputs]:
    return _text_vision(transformers.BlipConfig, transformers.BlipModel, projection_dim=16)


def metaclip_2() -> tuple[nn.Module, Inputs]:
    return _text_vision(transformers.MetaClip2Config, transformers.MetaClip2Model, projection_dim=16)


def clipseg() -> tuple[nn.Module, Inputs]:
    return _text_vision(transformers.CLIPSegConfig, transformers.CLIPSegModel, projection_dim=16)


def vision_text_dual_encoder() -> tuple[nn.Module, Inputs]:
    config = transformers.VisionTextDualEncoderConfig.from_vision_text_configs(
        transformers.ViTConfig(**_VISION), transformers.BertConfig(**_TEXT), projection_dim=16)
    return _seeded(lambda: transformers.VisionTextDualEncoderModel(config)), _both()


def tipsv2() -> tuple[nn.Module, Inputs]:
    vision = dict(image_size=16, patch_size=8, hidden_size=32, num_attention_heads=4, num_hidden_layers=2)
    config = transformers.Tipsv2Config(text_config=_TEXT, vision_config=vision)
    return _seeded(lambda: transformers.Tipsv2Model(config)), _both()


def aimv2() -> tuple[nn.Module, Inputs]:
    model, inputs = _text_vision(transformers.Aimv2Config, transformers.Aimv2Model, projection_dim=16)
    with torch.no_grad():  # past its clamp: the logits' scale is exp(max_log_logit_scale)
        model.logit_scale.fill_(model.max_log_logit_scale + 1)
    return model, inputs


def blip2_retrieval() -> tuple[nn.Module, Inputs]:
    config = transformers.Blip2Config(
        vision_config=_VISION,
        qformer_config=dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_attention_heads=4,
                            num_hidden_layers=2, encoder_hidden_size=32, max_position_embeddings=32,
                            use_qformer_text_input=True),
        num_query_tokens=3, image_text_hidden_size=16)
    model = _seeded(lambda: transformers.Blip2ForImageTextRetrieval(config))
    with torch.no_grad():  # zeros at first: their layer norm's gradient is ill-conditioned
        model.query_tokens.normal_()

    def inputs(n: int) -> dict[str, Any]:
        x = _both()(n)
        return {**x, "attention_mask": torch.ones_like(x["input_ids"])}

    return model, inputs


def xclip() -> tuple[nn.Module, Inputs]:
    vision = dict(num_frames=2, mit_hidden_size=32, mit_intermediate_size=37, mit_num_hidden_layers=1,
                  mit_num_attention_heads=4, **_VISION)
    config = transformers.XCLIPConfig(text_config=_TEXT, vision_config=vision, projection_dim=32,
                                      prompt_layers=1, prompt_attention_heads=4, prompt_hidden_act="gelu")

    def inputs(n: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(100 + n)
        return {**texts(n), "pixel_values": torch.randn(n, 2, 3, 16, 16, generator=g)}

    return _seeded(lambda: transformers.XCLIPModel(config)), inputs


class SmoothedCLIP(transformers.CLIPModel):
    """A user's CLIP whose loss is its own (smoothed labels): not what dpmethods can tell."""

    def forward(self, *args: Any, return_loss: bool | None = None, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        if return_loss:
            labels = torch.arange(len(out.logits_per_text))
            out.loss = nn.functional.cross_entropy(out.logits_per_text, labels, label_smoothing=0.2)
        return out


class SharperCLIP(transformers.CLIPModel):
    """A user's CLIP whose logits are scaled once more: not what its attributes say."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits_per_text = out.logits_per_text * 2
        out.logits_per_image = out.logits_per_text.t()
        return out


BUILDERS: dict[str, Callable[[], tuple[nn.Module, Inputs]]] = {
    "clip": clip,
    "siglip": siglip,
    "siglip2": siglip2,
    "align": align,
    "clap": clap,
    "chinese_clip": chinese_clip,
    "altclip": altclip,
    "groupvit": groupvit,
    "owlvit": owlvit,
    "owlv2": owlv2,
    "blip": blip,
    "metaclip_2": metaclip_2,
    "clipseg": clipseg,
    "vision_text_dual_encoder": vision_text_dual_encoder,
    "tipsv2": tipsv2,
    "aimv2": aimv2,
    "blip2_retrieval": blip2_retrieval,
}
"""The models whose logits and loss dpmethods computes over the whole batch."""
# Their forward returns no loss: the tests differentiate a function of the logits.
NO_LOSS = ("aimv2", "blip2_retrieval")
