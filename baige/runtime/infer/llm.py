"""The offline API: ``LLM(model).generate(prompts, params)``, ``LLM(model).chat(messages, params)`` and
``LLM(model, runner="pooling").embed(prompts)`` (vLLM's ``LLM``)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable

import torch

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.lora import LoRARequest
from baige.runtime.infer.outputs import EmbeddingRequestOutput, RequestOutput
from baige.runtime.infer.pooling import PoolingParams
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer

PromptType = str | list[int] | dict
Conversation = list[dict]


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

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to each conversation through the model's chat template (vLLM's ``LLM.chat``).

        Args:
            messages: one conversation ``[{"role": ..., "content": ...}, ...]`` or a list of them.
            sampling_params: as in :meth:`generate` (``structured_outputs`` constrain the reply).
            tools: OpenAI tool specs, given to the template as its ``tools`` variable (HF's convention,
                as vLLM's offline ``chat`` does; the output is not parsed into calls: ``baige serve``
                does that, and adds a tool prompt for templates that ignore ``tools``).
            chat_template: a Jinja template used instead of the model's, for these calls only.
            add_generation_prompt: end each prompt with the header of the assistant's turn.
            chat_template_kwargs: further template variables (``enable_thinking``, ...).
        Raises:
            BaigeError: no chat template, a template that rejects a conversation or does not compile,
                or bad parameters (nothing is generated then).
        """
        if not isinstance(messages, list) or not messages:
            raise BaigeError("messages: a conversation (a non-empty list of messages) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        if chat_template is not None:
            tok = copy.copy(tok)
            tok.set_chat_template(chat_template)
        extra = dict(chat_template_kwargs or {}, **({"tools": tools} if tools is not None else {}))
        prompts = []
        for k, conv in enumerate(conversations):
            if not isinstance(conv, list) or not all(isinstance(m, dict) and "role" in m for m in conv):
                raise BaigeError(f"messages[{k}]: a conversation is a list of {{'role': ..., 'content': ...}} dicts")
            try:
                prompts.append(tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **extra))
            except BaigeError:
                raise
            except Exception as e:  # the template met fields it cannot render (jinja2 type errors)
                raise BaigeError(
                    f"messages[{k}]: the chat template cannot render it ({type(e).__name__}: {str(e)[:200]})"
                ) from None
        return self.generate(prompts, sampling_params)

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in prompt order.

        Args:
            prompts: a string, a list of token ids, ``{"prompt_token_ids": [...]}``, or a list of these.
            sampling_params: one for all prompts or one per prompt (default: ``SamplingParams()``).
            lora_request: the adapter for all prompts or one per prompt (None: the base model); needs
                ``LLM(enable_lora=True)``; an adapter is loaded from its ``lora_path`` on first use.
        Raises:
            BaigeError: a bad prompt, parameters or adapter (nothing is generated then).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise BaigeError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise BaigeError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        ids = []
        for prompt, p, lora in zip(prompts, params_list, loras):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            self.engine.prepare(prompt, p)  # validate all (and load their adapters) before queueing any
            self.engine.resolve_lora(lora)
        for prompt, p, lora in zip(prompts, params_list, loras):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, p, lora_request=lora)
            ids.append(rid)
        return self.engine.run_to_completion(ids)

    def embed(
        self, prompts: PromptType | list[PromptType], pooling_params: PoolingParams | None = None
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (vLLM's ``LLM.embed``; needs the pooling runner: ``LLM(model,
        runner="pooling")`` or a pooling checkpoint); ``outputs.embedding`` of each, in prompt order.

        Args:
            prompts: as :meth:`generate`'s.
            pooling_params: ``dimensions`` (Matryoshka models) and ``normalize``, for all prompts.
        Raises:
            BaigeError: the generate runner, a bad prompt or parameters (nothing is queued then).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        if self.engine.pooler is None:
            raise BaigeError('embed() needs the pooling runner: LLM(model, runner="pooling")')
        prompts = [p.get("prompt_token_ids", p.get("prompt")) if isinstance(p, dict) else p for p in prompts]
        for prompt in prompts:
            self.engine.prepare_pooling(prompt, params)  # validate all before queueing any
        ids = []
        for prompt in prompts:
            ids.append(f"llm-{next(self._ids)}")
            self.engine.add_pooling_request(ids[-1], prompt, params)
        return self.engine.run_to_completion(ids)

    # ---- weights and memory (RL: the trainer's side of weight sync and colocation) ----------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], lora_name: str | None = None) -> None:
        """Copy ``(state-dict name, tensor)`` pairs (a trainer's ``named_parameters()``) into the engine's
        model in place and reset the prefix cache (:meth:`Engine.update_weights`); with ``lora_name``,
        the lora_A/lora_B weights of that loaded adapter instead (a LoRA run syncs only those).
        Raises BaigeError."""
        self.engine.update_weights(named_tensors, lora_name)

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache until :meth:`wake_up` (:meth:`Engine.sleep`). Raises BaigeError."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        """Allocate the KV cache again after :meth:`sleep`."""
        self.engine.wake_up()

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache (cached K/V of earlier prompts is not reused)."""
        self.engine.reset_prefix_cache()
