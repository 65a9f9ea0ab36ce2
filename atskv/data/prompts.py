"""A prompt as token ids, the same for every evaluation, the demo and the predictor's collection."""

from __future__ import annotations

import torch


def encode_prompt(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    """Token ids `[1, T]`; an instruct model's chat template wraps the prompt when `chat`."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    return ids
