"""batchgen as an lm-evaluation-harness model, registered as "batchgen" on import.

    import batchgen.integrations.lm_eval
    lm_eval.simple_evaluate(model="batchgen", model_args="pretrained=...,dtype=float32", tasks=[...])

or, with no Python: `batchgen eval --tasks ... --model_args ...` (lm-eval's own command line).

Model args follow lm-eval's conventions: `pretrained` (None: the default model), `dtype`,
`device`, `max_gen_toks` (256), `batch_size` and `max_batch_size` (accepted and ignored: batchgen
packs every request of a call into its own batches), and any batchgen engine option
(`kv_cache_memory=2GiB`, ...).

Invariants (lm-eval's `HFLM` contract): pairs are split and encoded as `batchgen.plan.scoring` does;
a pair longer than the model's context keeps its last `max_length + 1` tokens (the context is
cut from the left); `generate_until` encodes the context without special tokens, stops at
`until` strings, greedy unless `do_sample`.
"""

from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401 (lm-eval's own models first: its registry loads them only while it is empty)
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from batchgen.llm import LLM
from batchgen.sampling_params import SamplingParams
from batchgen.plan.scoring import encode_pair, encode_text

DEFAULT_MAX_GEN_TOKS = 256


@register_model("batchgen")
class BatchgenLM(LM):
    def __init__(self, pretrained: str | None = None, dtype: str = "auto", device: str | None = "auto",
                 batch_size: Any = None, max_batch_size: Any = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 **engine_options: Any):
        super().__init__()
        device = device or "auto"
        self.llm = LLM(pretrained, dtype=dtype, device=device, **engine_options)
        self.max_gen_toks = int(max_gen_toks)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> BatchgenLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> BatchgenLM:
        """Model args from lm-eval's `--model_args`; its command-line extras (device, batch size)
        fill only what the model args leave unset."""
        extra = {key: value for key, value in (additional_config or {}).items()
                 if value is not None and key not in arg_dict}
        return cls(**arg_dict, **extra)

    @property
    def max_length(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def tokenizer_name(self) -> str:
        return self.llm.tokenizer.name_or_path.replace("/", "__")

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._fit(*encode_pair(self.llm.tokenizer, *request.args)) for request in requests]
        return [self._checked(output, (output.logprob, output.is_greedy))
                for output in self.llm.score(pairs, use_tqdm=not disable_tqdm)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        texts = [request.args[0] for request in requests]
        return [self._checked(output, output.logprob)
                for output in self.llm.score_rolling(texts, use_tqdm=not disable_tqdm)]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for request in requests:
            context, gen_kwargs = request.args
            sampling = self._sampling(dict(gen_kwargs))
            prompts.append(encode_text(self.llm.tokenizer, context)[-(self.max_length - sampling.max_tokens):])
            params.append(sampling)
        return [output.text for output in self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.llm.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Cut the context from the left so the pair's input fits the model (as lm-eval's HFLM does)."""
        whole = (context + continuation)[-(self.max_length + 1):]
        return whole[: len(whole) - len(continuation)] or whole[:1], continuation[-(len(whole) - 1):]

    def _sampling(self, gen_kwargs: dict) -> SamplingParams:
        until = gen_kwargs.pop("until", None) or []
        max_tokens = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
        do_sample = bool(gen_kwargs.pop("do_sample", False))
        temperature = float(gen_kwargs.pop("temperature", 1.0 if do_sample else 0.0))
        return SamplingParams(max_tokens=max_tokens, temperature=temperature if do_sample else 0.0,
                              stop=[until] if isinstance(until, str) else list(until),
                              **{key: gen_kwargs[key] for key in ("top_p", "top_k", "seed") if key in gen_kwargs})

    @staticmethod
    def _checked(output, value):
        if output.error is not None:
            raise ValueError(f"batchgen could not score a request: {output.error}")
        return value
