"""Question answering over a haystack, after RULER's QA tasks (Hsieh et al., 2024,
arXiv:2404.06654) but with synthetic facts instead of SQuAD / HotpotQA paragraphs, so that the
answer is stated once in the prompt and nowhere in a model's prior: short facts about invented
people ("Lena Vorakim keeps a pet named Tusero.") are scattered through the filler and the
question asks one of them.

Distractors are facts about other people and one more fact about the asked person under another
relation, so that an answer needs both the person and the relation. Answers are capitalised
pseudo-words drawn from syllables; exact whole-word match scores them.
"""

from __future__ import annotations

import random

from atskv.data.tasks.example import TaskExample
from atskv.data.tasks.haystack import fresh_item, haystack_prompt

_HEAD = (
    "Facts about several people are scattered through the text below. Read them carefully: "
    "I will ask you a question about one of them afterwards.\n"
)
# (fact, question, the answer's lead-in): each relation names its answer last
_RELATIONS = (
    ("{p} lives in the town of {a}.", "In which town does {p} live?", "{p} lives in the town of"),
    ("{p} keeps a pet named {a}.", "What is the name of the pet {p} keeps?", "{p} keeps a pet named"),
    ("{p} works for a company called {a}.", "For which company does {p} work?", "{p} works for a company called"),
    ("{p} grew up on the island of {a}.", "On which island did {p} grow up?", "{p} grew up on the island of"),
)
_QUESTION = "\nQuestion: {question}\nAnswer: {lead}"
_FIRST_NAMES = "Lena Hugo Sofia Emil Nadia Viktor Greta Felix Alma Bruno Leila Ruben".split()
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def _word(rng: random.Random) -> str:
    return "".join(rng.choices(_SYLLABLES, k=rng.choice((2, 3)))).capitalize()


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST_NAMES)} {_word(rng)}"


def qa_example(
    tokenizer, n_tokens: int, depth: float, seed: int, filler: str | None = None, n_facts: int = 6
) -> TaskExample:
    """``n_facts`` facts (the asked one at ``depth``, the others at seeded random depths); the
    prompt ends with the asked relation's lead-in, so a base model continues with the answer."""
    if n_facts < 2:
        raise ValueError(f"n_facts must be at least 2 (the asked fact and a distractor), got {n_facts}")
    rng = random.Random(seed)
    taken: set[str] = set()
    asked = fresh_item(rng, _person, filler, taken)
    relation, other = rng.sample(range(len(_RELATIONS)), 2)
    subjects = [(asked, relation), (asked, other)]
    subjects += [(fresh_item(rng, _person, filler, taken), rng.randrange(len(_RELATIONS))) for _ in range(n_facts - 2)]
    answers = [fresh_item(rng, _word, filler, taken) for _ in subjects]
    facts = [_RELATIONS[r][0].format(p=p, a=a) for (p, r), a in zip(subjects, answers)]
    needles = [(depth, facts[0])] + [(rng.random(), fact) for fact in facts[1:]]
    _, question, lead = _RELATIONS[relation]
    tail = _QUESTION.format(question=question.format(p=asked), lead=lead.format(p=asked))
    hay = haystack_prompt(tokenizer, n_tokens, seed, filler, _HEAD, needles, tail)
    return TaskExample(hay.prompt, (answers[0],), hay.needle_token_ranges[:1], hay.n_tokens)
