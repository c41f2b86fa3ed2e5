"""What a draft worker's --model spec names, by its text alone: prompt lookup (`ngram[:...]`), suffix trees
(`suffix[:...]`), suffix trees before a model (`suffix[:...]+MODEL`), or a model. Read by the worker that loads it
and by whoever plans around it (a coordinator's configuration, a local cluster's thread settings, the bench);
it imports nothing heavy for them."""

NGRAM_PREFIX = "ngram"
SUFFIX_PREFIX = "suffix"


def is_ngram(spec: str) -> bool:
    return spec == NGRAM_PREFIX or spec.startswith(NGRAM_PREFIX + ":")


def is_suffix(spec: str) -> bool:
    """Suffix trees alone ('+' joins a model to them: a hybrid)."""
    return (spec == SUFFIX_PREFIX or spec.startswith(SUFFIX_PREFIX + ":")) and "+" not in spec


def split_hybrid(spec: str) -> tuple[str, str]:
    """('suffix[:...]', 'MODEL') for 'suffix[:...]+MODEL'; ('', spec) for any other spec."""
    head, plus, model = spec.partition("+")
    return (head, model) if plus and is_suffix(head) else ("", spec)


def is_model_free(spec: str) -> bool:
    """A proposer without a model: it computes nothing to speak of, so it needs no cores of its own."""
    return is_ngram(spec) or is_suffix(spec)
