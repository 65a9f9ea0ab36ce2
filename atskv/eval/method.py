"""A method: what a row of an evaluation runs, a selector (or a kvpress press) and the runtime that
runs it, one value spelled alike in commands, result files and tables, so that every evaluator
and the CLI read `tiered:learned` the same way.

Spelling: `RUNTIME:NAME`; a bare `NAME` runs on the evaluator's own atskv runtime (the fast path,
or the reference hook where the evaluator says so); a runtime that needs no selector stands alone
(`plain`, `vllm`); ` (LABEL)` after a method names it under other settings (a leaderboard
variant, `learned (window 0.5)`). Parsing is plain Python, as the vLLM engine processes need (they
run without atskv's selectors); `check_methods` also checks the names, before any work."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from atskv.errors import InputError

OWN, HOOK, TIERED, HOST, VLLM, KVPRESS, PLAIN, PLAIN_STATIC = (
    "", "hook", "tiered", "host", "vllm", "kvpress", "plain", "plain-static"
)  # fmt: skip
RUNTIMES = {
    OWN: "atskv on the evaluator's own path",
    HOOK: "the reference hook (atskv.sparse under transformers' generate)",
    TIERED: "the reference two-tier store (atskv.tiered under transformers' generate)",
    HOST: "the fast path with its host tier (atskv.generate with HostRetrieval)",
    VLLM: "vLLM: alone its own attention, with a selector atskv's plugin",
    KVPRESS: "a press of NVIDIA kvpress, in its own environment",
    PLAIN: "transformers' generate with its own cache, no atskv",
    PLAIN_STATIC: "transformers' generate with its static cache, its decode step compiled",
}
WITHOUT_SELECTOR = (PLAIN, PLAIN_STATIC)  # never take one
MAY_STAND_ALONE = (*WITHOUT_SELECTOR, VLLM)

DENSE = "dense"  # the full KV, the reference beside every row
KVPRESS_FULL = "none"  # kvpress's own full-KV run, the dense beside its presses
KVPRESS_PRESSES = ("snapkv", "streaming_llm", "observed_attention", "expected_attention", "tova", "kvzip")


@dataclass(frozen=True)
class Method:
    """`runtime`: a key of `RUNTIMES`; `name`: a selector or composition (`learned+sparq`), a
    kvpress press, or "" for a runtime that stands alone; `variant`: the label of a run with
    other settings."""

    runtime: str = OWN
    name: str = ""
    variant: str = ""

    def __post_init__(self):
        if self.runtime not in RUNTIMES:
            raise InputError(f"{self}: unknown runtime {self.runtime!r}; runtimes: {spelled(RUNTIMES)}")
        if self.runtime in WITHOUT_SELECTOR and self.name:
            raise InputError(f"{self}: {self.runtime} runs no selector ({RUNTIMES[self.runtime]})")
        if not self.name and self.runtime not in MAY_STAND_ALONE:
            raise InputError(f"{str(self)!r}: a method names a selector, as {spelled([self.runtime])}")

    @classmethod
    def parse(cls, text: str) -> Method:
        """The method `text` spells (the module says how); an `InputError` for an unknown runtime."""
        base, variant = text, ""
        if text.endswith(")") and " (" in text:
            base, variant = text[:-1].split(" (", 1)
        if base in MAY_STAND_ALONE:
            return cls(base, "", variant)
        runtime, colon, name = base.partition(":")
        if not colon:
            return cls(OWN, base, variant)
        if not runtime:
            raise InputError(f"{text!r}: unknown runtime ''; runtimes: {spelled(RUNTIMES)}")
        return cls(runtime, name, variant)

    def __str__(self) -> str:
        text = self.runtime if not self.name else f"{self.runtime}:{self.name}" if self.runtime else self.name
        return f"{text} ({self.variant})" if self.variant else text


def spelled(runtimes: Iterable[str]) -> str:
    """How methods of `runtimes` are written, for messages: `<selector>, tiered:<selector>, ...`."""
    forms = {OWN: "<selector>", KVPRESS: "kvpress:<press>", VLLM: "vllm, vllm:<selector>"}
    return ", ".join(forms.get(r, r if r in WITHOUT_SELECTOR else f"{r}:<selector>") for r in runtimes)


def check_methods(texts: Iterable[str], runtimes: Sequence[str]) -> list[Method]:
    """The methods of `texts`, or an `InputError` before any work: a label, a runtime the
    evaluator does not run (it runs `runtimes`), an unknown selector or a composition whose parts
    cannot play their roles, an unknown kvpress press."""
    from atskv.selectors import check_selector_names  # here: parsing alone stays free of the selectors

    methods = [Method.parse(text) for text in texts]
    for method in methods:
        if method.variant:
            raise InputError(f"{method}: a label comes from merging runs (--variant); name the method alone")
        if method.runtime not in runtimes:
            where = RUNTIMES[method.runtime]
            raise InputError(f"{method} ({where}) does not run here; methods here: {spelled(runtimes)}")
        if method.runtime == KVPRESS:
            if method.name not in KVPRESS_PRESSES:
                raise InputError(f"unknown kvpress press {method.name!r}; choose from: {', '.join(KVPRESS_PRESSES)}")
        elif method.runtime == VLLM and method.name:
            from atskv.runtime.vllm.composition import paged_selector_parts  # pure torch: no vLLM needed

            try:
                paged_selector_parts(method.name)
            except InputError as error:
                raise InputError(f"{method}: {error}") from None
        elif method.name:
            try:
                check_selector_names([method.name])
            except InputError:
                raise
            except ValueError as error:  # an unknown name: say what else a method may be
                raise InputError(f"{error} (methods: {spelled(runtimes)})") from None
    return methods
