"""The recipe's `model` section: a preset, an explicit Llama-style shape, a Hugging Face config.json, or only a
parameter count, resolved into the one `catalog.ModelShape` the planner and the runtime both build from."""

from typing import Any, Literal

from .. import catalog
from .fields import Doc, Float, Int, Invalid, Spec, Str, suggest

# The fields that give a model's shape (model.hf gives all of them; a preset's values fill those left unset).
_SHAPE = ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "tied_embeddings", "rope_theta")
DEFAULT_SEQ_LEN = 2048


class ModelSpec(Spec, kw_only=True):
    """Either a preset, an explicit shape, or only a parameter count (model states only)."""

    preset: Doc("e.g. llama3-70b, llama2-7b, tiny", str | None) = None
    architecture: Doc(
        "gpt = the Korthikanti et al. reference layer (planning only: the runtime trains llama)",
        Literal["llama", "gpt"],
    ) = "llama"
    layers: Int(1, 100000) | None = None
    hidden: Int(1, 10000000) | None = None
    ffn_hidden: Int(1, 100000000) | None = None
    heads: Int(1, 100000) | None = None
    kv_heads: Int(1, 100000) | None = None
    vocab: Int(1, 100000000) | None = None
    tied_embeddings: bool | None = None
    params: Int(1, 10**15, "parameter count, when the shape is unknown") | None = None
    seq_len: Int(1, 100000000) | None = None
    rope_theta: Float(gt=0, le=1000000000000.0) | None = None
    hf: Doc(
        "a Hugging Face model directory (config.json, optional *.safetensors), relative to the recipe file: "
        "Llama, Mistral or Qwen2; the runtime builds it with transformers",
        Str | None,
    ) = None
    hf_config: Doc(
        "filled in by dtlaunch from model.hf's config.json (the resolved recipe carries it)", dict[str, Any] | None
    ) = None
    hf_weights: Doc(
        "the directory of the *.safetensors weights as the nodes see it (default: model.hf when it "
        "holds weights); unset: train from random initialisation",
        Str | None,
    ) = None

    def __post_init__(self) -> None:
        if self.preset is not None and self.preset not in catalog.PRESETS:
            raise Invalid(
                "preset",
                f"unknown preset {self.preset!r}{suggest(self.preset, catalog.PRESETS)}; "
                f"known: {', '.join(catalog.PRESETS)}",
            )
        if self.hf is not None or self.hf_config is not None:
            return self._hf_complete()
        if self.hf_weights is not None:
            raise ValueError("hf_weights needs model.hf (the weights of a Hugging Face model)")
        shape_fields = ("layers", "hidden", "ffn_hidden", "heads", "vocab")
        given = [f for f in shape_fields if getattr(self, f) is not None]
        if self.preset is None and self.params is None and len(given) < len(shape_fields):
            missing = [f for f in shape_fields if getattr(self, f) is None]
            raise ValueError("the model needs a `preset`, a full shape, or `params`; missing: " + ", ".join(missing))
        s = self.shape()
        if s is not None:
            if s.hidden % s.heads:
                raise ValueError(
                    f"hidden {s.hidden} is not divisible by heads {s.heads}: each head gets hidden/heads dimensions"
                )
            if s.heads % s.kv_heads:
                raise ValueError(
                    f"heads {s.heads} is not divisible by kv_heads {s.kv_heads}: each kv head serves "
                    "heads/kv_heads query heads"
                )
            if (s.hidden // s.heads) % 2:
                raise ValueError(
                    f"the head dimension hidden/heads = {s.hidden // s.heads} is odd: rotary position "
                    "embeddings rotate pairs of dimensions"
                )

    def _hf_complete(self) -> None:
        from .hf import HFConfigError, shape_fields

        others = [f for f in ("preset", *_SHAPE, "params") if getattr(self, f) is not None]
        if others:
            raise ValueError(f"model.hf gives the whole shape; remove {', '.join(others)} (seq_len may stay)")
        if self.hf_config is None:
            raise ValueError("model.hf: its config.json was not read (load the recipe from its file)")
        if self.architecture != "llama":
            raise ValueError("model.hf models are Llama-style decoders: leave model.architecture unset")
        try:
            shape_fields(self.hf_config, self.seq_len)
        except HFConfigError as e:
            raise ValueError(str(e)) from None

    def shape(self) -> catalog.ModelShape | None:
        """The resolved shape (preset with explicit overrides), or None for a params-only model."""
        if self.hf_config is not None:
            from .hf import shape_fields

            return catalog.ModelShape(**shape_fields(self.hf_config, self.seq_len))
        base = catalog.PRESETS.get(self.preset) if self.preset else None
        if base is None and self.layers is None:
            return None
        vals: dict[str, Any] = {}  # int, bool or float by field; None until a default fills it
        for f in (*_SHAPE, "seq_len"):
            v = getattr(self, f)
            vals[f] = v if v is not None else (getattr(base, f) if base else None)
        if None in (vals["layers"], vals["hidden"], vals["heads"], vals["vocab"]):
            return None
        if vals["kv_heads"] is None:
            vals["kv_heads"] = vals["heads"]
        if vals["tied_embeddings"] is None:
            vals["tied_embeddings"] = False
        if vals["ffn_hidden"] is None:
            vals["ffn_hidden"] = 4 * vals["hidden"]
        if vals["seq_len"] is None:
            vals["seq_len"] = DEFAULT_SEQ_LEN
        if vals["rope_theta"] is None:
            vals["rope_theta"] = 10000.0
        return catalog.ModelShape(**vals)

    def seq(self) -> int:
        s = self.shape()
        return s.seq_len if s else (self.seq_len or DEFAULT_SEQ_LEN)
