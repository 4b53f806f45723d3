"""Export a draft made by `specmtp distill` as a plain Hugging Face Llama model directory.

A `DraftLM` borrows its target's embedding and LM-head rows at load time, so its files alone
are no model. Exported, it becomes a stand-alone `LlamaForCausalLM` (config.json,
model.safetensors and the target's tokenizer) that any tool taking an HF assistant model can
load: transformers' `generate(assistant_model=...)`, our `--draft DIR`, `hf-assisted:DIR`.

What changes on the way out. An HF causal LM must score the whole vocabulary, where a draft
gives its non-draft-vocabulary tokens probability 0. The draft never learnt those tokens'
logits (with the target's rows they win the argmax at about 40% of positions), so the
exported LM head keeps the target's rows for the draft vocabulary and zero rows elsewhere:
those tokens get logit 0, below the draft's best logit whenever that is positive (almost
always for a trained draft), and a tiny share of q when sampling. The head is then untied
from the embedding (a second V x H matrix in the file). A draft without a draft vocabulary
keeps the target's head as it is, tied if the target ties it. MTP heads are not exported
(an HF causal LM has no place for them): the model drafts one token per forward, as
`distilled-mtp-ar` does.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specmtp.draft_model import DraftLM, output_weight
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel


def to_hf_llama(draft: DraftLM, target: LoadedModel) -> LlamaForCausalLM:
    """A LlamaForCausalLM computing the draft's hidden states, with the target's full
    embedding and LM head (tied when the target ties them)."""
    text = target.model.config.get_text_config()
    embedding = target.model.get_input_embeddings().weight
    output = output_weight(target.model)
    vocab = draft.draft_config.draft_vocab
    tied = vocab is None and output.data_ptr() == embedding.data_ptr()
    body = draft.body.config
    config = LlamaConfig(
        **draft.draft_config.body, num_hidden_layers=len(draft.body.layers),
        vocab_size=output.shape[0], tie_word_embeddings=tied,
        bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id, attention_bias=body.attention_bias,
        mlp_bias=body.mlp_bias,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(draft.dtype).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(embedding)
        model.model.layers.load_state_dict(draft.body.layers.state_dict())
        model.model.norm.load_state_dict(draft.body.norm.state_dict())
        if not tied:
            model.lm_head.weight.copy_(output if vocab is None else _rows_only(output, vocab))
    model.generation_config = target.model.generation_config
    return model.requires_grad_(False)


def _rows_only(weight: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """`weight` [V, H] with every row outside `rows` set to zero."""
    kept = torch.zeros_like(weight)
    index = torch.tensor(rows, dtype=torch.long)
    kept[index] = weight[index]
    return kept


def export_hf_draft(
    draft: DraftLM, target: LoadedModel, out: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Write the draft as an HF model directory with the target's tokenizer; return it."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SpecMTPError(f"{out} exists and is not empty; export into a new directory")
    model = to_hf_llama(draft, target)
    if dtype is not None:
        model = model.to(dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    return out
