"""Privacy accounting for the ESA pipeline (docs/accounting.md).

Every bound returns an immutable :class:`BoundResult`; :func:`certify` gathers the bounds
that apply to a mechanism's :class:`LocalRandomizer` description and picks the certificate;
:func:`plan_eps0` inverts it.
:func:`compose_epochs` / :func:`lifetime_for_mechanism` give a user's lifetime ε over all
epochs (privacy-loss distributions), and :func:`plan_eps0_lifetime` inverts that.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.accounting.composition import (
        EpsDelta,
        advanced_composition_bun_steinke,
        advanced_composition_drv,
        basic_composition,
        best_composition,
        compose_with_deletion,
        deletion_offset,
        deletion_utility_bound,
        removal_to_replacement,
        replacement_to_removal,
        subsample,
    )
    from common.accounting.lifetime import (
        Certificate,
        DeltaSplit,
        Epoch,
        LifetimeResult,
        compose_epochs,
        lifetime_for_mechanism,
        plan_eps0_lifetime,
    )
    from common.accounting.local import composed_randomizer_eps, esa_thm_iv1, fragment_eps
    from common.accounting.lower import lower_2rr
    from common.accounting.planner import Plan, plan_eps0
    from common.accounting.randomizers import (
        BackstopFragments,
        BalcerCheuNoise,
        BinaryRR,
        BinaryRRSequence,
        Certification,
        GenericRandomizer,
        KaryRR,
        LocalRandomizer,
        MethodSpec,
        RemovalRandomizer,
        best_bound,
        certify,
        compute_bounds,
        methods_for,
        rfrag_across_batches,
    )
    from common.accounting.results import BoundResult, Method, Neighbouring
    from common.accounting.shuffle_bounds import (
        balcer_cheu_thm12,
        blanket_binary_rr,
        blanket_krr,
        cheu_lemma_ii6,
        efmrtt19_thm7,
        esa_thm_iii1,
        fmt21_clones,
        fmt21_closed,
        fmt21_krr_cor42,
        fmt21_thm38,
    )

#: The submodule of every public name: the package imports it on first use (PEP 562), so that
#: reading the identifiers of :mod:`.results` does not load dp_accounting and scipy.
_WHERE = {
    "BackstopFragments": "randomizers",
    "BalcerCheuNoise": "randomizers",
    "BinaryRR": "randomizers",
    "BinaryRRSequence": "randomizers",
    "GenericRandomizer": "randomizers",
    "KaryRR": "randomizers",
    "LocalRandomizer": "randomizers",
    "MethodSpec": "randomizers",
    "RemovalRandomizer": "randomizers",
    "BoundResult": "results",
    "Certificate": "lifetime",
    "Certification": "randomizers",
    "DeltaSplit": "lifetime",
    "Epoch": "lifetime",
    "EpsDelta": "composition",
    "LifetimeResult": "lifetime",
    "Method": "results",
    "Neighbouring": "results",
    "Plan": "planner",
    "advanced_composition_bun_steinke": "composition",
    "advanced_composition_drv": "composition",
    "balcer_cheu_thm12": "shuffle_bounds",
    "basic_composition": "composition",
    "best_bound": "randomizers",
    "best_composition": "composition",
    "blanket_binary_rr": "shuffle_bounds",
    "blanket_krr": "shuffle_bounds",
    "certify": "randomizers",
    "cheu_lemma_ii6": "shuffle_bounds",
    "compose_epochs": "lifetime",
    "compose_with_deletion": "composition",
    "composed_randomizer_eps": "local",
    "compute_bounds": "randomizers",
    "deletion_offset": "composition",
    "deletion_utility_bound": "composition",
    "efmrtt19_thm7": "shuffle_bounds",
    "esa_thm_iii1": "shuffle_bounds",
    "esa_thm_iv1": "local",
    "fmt21_clones": "shuffle_bounds",
    "fmt21_closed": "shuffle_bounds",
    "fmt21_krr_cor42": "shuffle_bounds",
    "fmt21_thm38": "shuffle_bounds",
    "fragment_eps": "local",
    "lifetime_for_mechanism": "lifetime",
    "lower_2rr": "lower",
    "methods_for": "randomizers",
    "plan_eps0": "planner",
    "plan_eps0_lifetime": "lifetime",
    "removal_to_replacement": "composition",
    "replacement_to_removal": "composition",
    "rfrag_across_batches": "randomizers",
    "subsample": "composition",
}


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first use."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "BackstopFragments",
    "BalcerCheuNoise",
    "BinaryRR",
    "BinaryRRSequence",
    "BoundResult",
    "Certificate",
    "Certification",
    "DeltaSplit",
    "Epoch",
    "EpsDelta",
    "GenericRandomizer",
    "KaryRR",
    "LifetimeResult",
    "LocalRandomizer",
    "Method",
    "MethodSpec",
    "Neighbouring",
    "Plan",
    "RemovalRandomizer",
    "advanced_composition_bun_steinke",
    "advanced_composition_drv",
    "balcer_cheu_thm12",
    "basic_composition",
    "best_bound",
    "best_composition",
    "blanket_binary_rr",
    "blanket_krr",
    "certify",
    "cheu_lemma_ii6",
    "compose_epochs",
    "compose_with_deletion",
    "composed_randomizer_eps",
    "compute_bounds",
    "deletion_offset",
    "deletion_utility_bound",
    "efmrtt19_thm7",
    "esa_thm_iii1",
    "esa_thm_iv1",
    "fmt21_clones",
    "fmt21_closed",
    "fmt21_krr_cor42",
    "fmt21_thm38",
    "fragment_eps",
    "lifetime_for_mechanism",
    "lower_2rr",
    "methods_for",
    "plan_eps0",
    "plan_eps0_lifetime",
    "removal_to_replacement",
    "replacement_to_removal",
    "rfrag_across_batches",
    "subsample",
]
