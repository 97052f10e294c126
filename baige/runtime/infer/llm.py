"""The offline API: ``LLM(model).generate(prompts, params)`` (vLLM's ``LLM``)."""

from __future__ import annotations

import itertools

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.outputs import RequestOutput
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer

PromptType = str | list[int] | dict


class LLM:
    """Offline batched generation: ``LLM(model).generate(prompts, params)``.

    Args:
        model: a model spec (see ``weights.hub.resolve_model``); None for the embedded default.
        **engine_args: any :class:`EngineConfig` field (dtype, max_model_len, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = Engine.from_config(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        Args:
            prompts: a string, a list of token ids, ``{"prompt_token_ids": [...]}``, or a list of these.
            sampling_params: one for all prompts or one per prompt (default: ``SamplingParams()``).
        Raises:
            BaigeError: a bad prompt or parameters (nothing is generated then).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise BaigeError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params_list):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            self.engine.prepare(prompt, p)  # validate all before queueing any
        for prompt, p in zip(prompts, params_list):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p)
            ids.append(rid)
        return self.engine.run_to_completion(ids)
