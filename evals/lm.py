"""An lm-eval `LM` backed by quantgate's `LLMEngine`, in process.

Every request of a call is submitted to the engine at once (`add_request`) and the engine is stepped
until all finish, so continuous batching and prefix caching do the scheduling. Tokenization follows
lm-eval's `TemplateLM`/`TemplateAPI` rules exactly (no special tokens added, BOS-or-EOS prefix for an
empty context, the same rolling windows), so this path and `local-completions` over HTTP score the
same token sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256


class EngineLM(TemplateLM):
    backend = "causal"

    def __init__(self, engine: Any, model_name: str = "engine", max_length: int | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, show_progress: bool = True) -> None:
        super().__init__()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        engine_len = int(getattr(engine, "max_model_len", DEFAULT_MAX_LENGTH) or DEFAULT_MAX_LENGTH)
        # Scoring sends the whole sequence plus max_tokens=1, which must fit the engine's context.
        self.max_length = min(max_length or DEFAULT_MAX_LENGTH, engine_len - 1)
        self.max_gen_toks = max_gen_toks
        self.show_progress = show_progress

    @classmethod
    def from_model(cls, ref: str, **engine_kwargs: Any) -> EngineLM:
        from serving import LLMEngine

        engine = LLMEngine.from_pretrained(str(ref), **engine_kwargs)
        return cls(engine, model_name=str(ref))

    # ------------------------------------------------------------------ tokenization (TemplateAPI rules)
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "engine")).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer(string, add_special_tokens=bool(add_special_tokens),
                              return_attention_mask=False).input_ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # ------------------------------------------------------------------ engine driving
    def _run(self, prompts: list[list[int]], params: list[Any], desc: str) -> list[Any]:
        """Submit everything, step until done; returns the final RequestOutput per prompt, in order."""
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        index = {rid: i for i, rid in enumerate(ids)}
        finals: list[Any] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc=desc, disable=not self.show_progress or len(ids) < 2)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    i = index.get(out.request_id)
                    if i is not None and out.finished and finals[i] is None:
                        finals[i] = out
                        bar.update(1)
        except BaseException:
            for rid, i in index.items():
                if finals[i] is None:
                    self.engine.abort(rid)
            raise
        finally:
            bar.close()
        missing = [ids[i] for i, out in enumerate(finals) if out is None]
        if missing:
            raise RuntimeError(f"engine finished without output for {len(missing)} request(s): {missing[:3]}")
        return finals

    def _score_params(self, ctxlen: int) -> Any:
        """Only the continuation is scored: the head and log-softmax skip the context's rows."""
        from serving import SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, prompt_logprobs_from=max(ctxlen, 1))

    def _score(self, seqs: list[tuple[list[int], int]], desc: str) -> list[tuple[float, bool]]:
        """Each (tokens, ctxlen): sum of logprobs of tokens[ctxlen:] and whether each was the argmax."""
        outs = self._run([tokens for tokens, _ in seqs], [self._score_params(c) for _, c in seqs], desc)
        results = []
        for (tokens, ctxlen), out in zip(seqs, outs, strict=True):
            plps = out.prompt_logprobs
            if plps is None or len(plps) != len(tokens):
                raise RuntimeError(f"engine returned {0 if plps is None else len(plps)} prompt logprobs "
                                   f"for {len(tokens)} prompt tokens")
            total, greedy = 0.0, True
            for pos in range(max(ctxlen, 1), len(tokens)):
                entry = plps[pos]
                total += entry.logprob
                if entry.top and entry.top[0][0] != tokens[pos]:
                    top_id, top_lp = entry.top[0]
                    greedy = greedy and top_lp <= entry.logprob
            results.append((total, greedy))
        return results

    def _truncate(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[list[int], int]:
        inp = (context_enc + continuation_enc)[-self.max_length:]
        ctxlen = len(context_enc) - max(0, len(context_enc) + len(continuation_enc) - self.max_length)
        return inp, ctxlen

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        seqs = [self._truncate(ctx, cont) for _, ctx, cont in requests]
        return self._score(seqs, desc="loglikelihood")

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        seqs: list[tuple[list[int], int]] = []
        owner: list[int] = []
        for i, (string,) in enumerate(req.args for req in requests):
            windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1, context_len=1))
            for ctx, pred in windows:
                seqs.append(self._truncate(ctx, pred))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._score(seqs, desc="loglikelihood_rolling"), strict=True):
            totals[i] += logprob
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        from serving import SamplingParams

        prompts, params, stops = [], [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [u for u in ([until] if isinstance(until, str) else until) if u]
            eos = self.tokenizer.eos_token
            if eos and eos not in until:
                until.append(eos)
            max_gen = int(kwargs.pop("max_gen_toks", kwargs.pop("max_tokens", self.max_gen_toks)))
            do_sample = bool(kwargs.pop("do_sample", False))
            temperature = float(kwargs.pop("temperature", 0.0)) if do_sample else 0.0
            enc = self.tok_encode(context)[-(self.max_length - max_gen):]
            prompts.append(enc)
            params.append(SamplingParams(max_tokens=max_gen, temperature=temperature, stop=until))
            stops.append(until)
        outs = self._run(prompts, params, desc="generate_until")
        return [_cut_at_stop(out.text, stop) for out, stop in zip(outs, stops, strict=True)]


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """The engine applies stop strings; cutting again is a no-op then, and a guard if not."""
    cut = len(text)
    for stop in stops:
        if stop:
            pos = text.find(stop)
            if pos != -1:
                cut = min(cut, pos)
    return text[:cut]
