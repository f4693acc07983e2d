"""Offline models: seeded tiny presets, a locally trained tokenizer, and one loader for
preset names, local HF directories and hub ids."""

from furlong.models.loading import load_model, load_tokenizer, save_hf_dir
from furlong.models.presets import PRESETS, build_preset

__all__ = ["PRESETS", "build_preset", "load_model", "load_tokenizer", "save_hf_dir"]
