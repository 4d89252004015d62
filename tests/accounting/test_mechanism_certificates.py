"""Per-mechanism certification: which bounds apply and how they relate."""

from __future__ import annotations

import math

import pytest

from common.accounting import (
    BackstopFragments,
    BalcerCheuNoise,
    BinaryRR,
    BinaryRRSequence,
    GenericRandomizer,
    KaryRR,
    certify,
    fragment_eps,
    methods_for,
    randomizers,
)
from common.accounting import shuffle_bounds as sb


def test_rfrag_is_capped_by_eps_l_inf_and_never_uses_printed_first_term() -> None:
    cert = certify(BackstopFragments(eps_f=2.0, tau=2), 10.0, 10**6, 1e-8)
    eps_inf = fragment_eps(10.0, 2.0, 2)
    assert all(b.eps <= eps_inf + 1e-12 for b in cert.bounds)
    iv2 = next(b for b in cert.bounds if b.method == randomizers.ESA_THM_IV2)
    assert "first term not used" in iv2.note
    assert cert.local[0].note.startswith("local ε_ℓ∞")


def test_longitudinal_uses_half_eps_per_report() -> None:
    whole = certify(BinaryRRSequence(), 4.0, 50_000, 1e-8).certified
    krappor_half = certify(BinaryRR(), 2.0, 50_000, 1e-8).certified
    assert whole.eps == pytest.approx(krappor_half.eps)


def test_krr_numerical_beats_corollary_for_large_k() -> None:
    cert = certify(KaryRR(k=1000), 6.0, 10**6, 1e-8)
    by_method = {b.method: b for b in cert.bounds}
    assert by_method[sb.BLANKET_KRR].eps < by_method[sb.FMT21_KRR_COR42].eps
    assert cert.lower is None


def test_generic_with_delta0_uses_theorem_38_only() -> None:
    cert = certify(GenericRandomizer(delta0=1e-13), 2.0, 10**6, 1e-6)
    assert cert.certified.method == sb.FMT21_THM38
    assert {b.method for b in cert.bounds} == {sb.FMT21_THM38, randomizers.LOCAL}


def test_zsum_certificate_and_methods() -> None:
    cert = certify(BalcerCheuNoise(), 0.5, 10**5, 2e-6)
    assert cert.certified.method == sb.BALCER_CHEU_THM12
    assert cert.certified.eps == pytest.approx(1.0)
    assert cert.other_notion.neighbouring == "removal"
    assert methods_for(BalcerCheuNoise()) == (sb.BALCER_CHEU_THM12,)


def test_rfrag_across_batches_is_a_capped_mixture_of_per_batch_bounds() -> None:
    from common.accounting import blanket_binary_rr, rfrag_across_batches

    same = rfrag_across_batches(6.0, 2.0, [10**5] * 4, [1] * 4, 1e-8)
    per_batch = blanket_binary_rr(2.0, 10**5, 1e-8 / 4).eps
    expected = math.log1p(math.tanh(3.0) * math.expm1(4 * per_batch))
    assert same.eps == pytest.approx(expected) and same.method == randomizers.RFRAG_PER_BATCH
    smaller = rfrag_across_batches(6.0, 2.0, [10**5, 10**5, 10**5, 50_000], [1] * 4, 1e-8)
    assert smaller.eps > same.eps
    capped = rfrag_across_batches(3.0, 5.0, [100], [4], 1e-8)
    assert capped.eps == pytest.approx(fragment_eps(3.0, 5.0, 4))
    with pytest.raises(ValueError, match="equal length"):
        rfrag_across_batches(3.0, 1.0, [100, 100], [1], 1e-8)


def test_krr_with_two_values_and_delta0_edge_cases() -> None:
    from common.accounting import plan_eps0

    assert certify(KaryRR(k=2), 1.0, 10**4, 1e-6).lower is not None
    cert = certify(GenericRandomizer(delta0=1e-3), 3.0, 1000, 1e-6)
    trivial = cert.bounds[-1]
    assert trivial.method == randomizers.LOCAL and trivial.delta == 1e-3
    plan = plan_eps0(1.0, 1e-6, 10**6, GenericRandomizer(delta0=1e-14))
    assert plan.certification.certified.method == sb.FMT21_THM38
    assert plan.certification.certified.eps <= 1.0


def test_longitudinal_accepts_a_single_change_bound() -> None:
    from common.mechanisms import get

    longitudinal = get("longitudinal")
    params = longitudinal.parse_params({"d": 8, "k": 1, "eps": 4.0})
    cert = longitudinal.privacy(params).certify(10_000, 1e-8)
    assert cert.certified.certifiable
    assert cert.certified.eps == certify(BinaryRRSequence(), 4.0, 10_000, 1e-8).certified.eps
    with pytest.raises(ValueError, match="k must be an integer >= 2"):
        KaryRR(k=1)


def test_balcer_cheu_certifies_at_the_delta_its_noise_was_sized_for() -> None:
    """Theorem 12 holds for the δ the noise was calibrated with alone: asking for a smaller δ
    still certifies (ε, δ_sized), and says so in the certificate's δ."""
    sized = BalcerCheuNoise(n_declared=10**5, delta=2e-6)
    asked = certify(sized, 0.5, 10**5, 1e-9).certified
    plain = certify(BalcerCheuNoise(n_declared=10**5), 0.5, 10**5, 2e-6).certified
    assert asked.delta == pytest.approx(2e-6) == plain.delta
    assert asked.eps == plain.eps
    with pytest.raises(ValueError, match=r"delta=2\.0"):
        BalcerCheuNoise(delta=2.0)
