"""The default channel catalogue: one channel per mechanism, sized for ``esa demo``.

``esa up`` writes it to ``<var>/channels.json`` (README.md, "Deployment"); a deployment
of one's own lists its channels there instead.
"""

from __future__ import annotations

from common.wire import ChannelConfig

#: Randomized deletion (ESA-revisited Algorithm 3) of every default channel.
DELETION = {"eps_cr": 1.0, "delta_cr": 1e-6}

#: The default channel set shows every mechanism (README.md, "Deployment"). Local ε are
#: chosen so that a demo-sized crowd (~500 per shuffler) already shows amplification, and
#: ``max_fragments`` sits at least 8 standard deviations above each encoder's fragment count
#: (tests/services/test_launcher.py samples the encoders to keep it so), and ``min_fragments`` is
#: the fewest an honest contribution carries, so shufflers refuse reports no device sends and
#: the analyzer can hold each batch's claimed crowd to its fragments.
#:
#: Domain sizes are what the demo can afford: every fragment costs one HPKE seal on the device
#: and one open at the analyzer (~0.19 ms of CPU together), and a k-RAPPOR report holds
#: (1 − p) + (k − 1)·p fragments on average, p = 1/(1 + e^ε) (ESA-revisited Algorithm 1).
#: At k = 256 and 1,024 the four histogram channels sent ~177 fragments per device; at k = 64
#: and 16×16 pixels ~52,
#: which keeps ``esa demo``'s 15,000 devices within a few minutes on 2 cores. Central ε per
#: attribute does not depend on k (the blanket bound of Lemma II.6 is per bit).
DEFAULT_CHANNELS = [
    ChannelConfig(
        id="homepage",
        title="Heavy-hitter pages (k-RAPPOR attribute fragments)",
        mechanism="krappor",
        params={"k": 64, "eps": 2.0},
        min_crowd=50,
        **DELETION,
        max_fragments=32,
        delta=1e-8,
    ),
    ChannelConfig(
        id="homepage-fragments",
        title="Same, with report fragments and backstops",
        mechanism="rfrag",
        params={"k": 64, "eps_b": 3.0, "eps_f": 2.5, "tau": 3},
        min_crowd=50,
        **DELETION,
        max_fragments=72,  # all τ rows in one contribution when a deployment runs 1 shuffler
        delta=1e-8,
    ),
    ChannelConfig(
        id="picture",
        title="An image channel (16x16 pixels)",
        mechanism="krappor",
        params={"k": 256, "eps": 3.0},
        min_crowd=50,
        **DELETION,
        max_fragments=48,
        delta=1e-8,
        display="image",
        image_shape=(16, 16),
    ),
    ChannelConfig(
        id="abroad",
        title="Longitudinal: state changed (a period is one 10-second epoch here)",
        mechanism="longitudinal",
        params={"d": 4, "k": 2, "eps": 4.0},
        epoch_seconds=10,
        min_crowd=20,
        **DELETION,
        min_fragments=1,  # one report per contribution: a batch's crowd is exactly its reports
        max_fragments=1,
        delta=1e-8,
        display="series",
    ),
    ChannelConfig(
        id="features",
        title="Balcer-Cheu zero-sum histogram",
        mechanism="zsum",
        # The declared crowd fixes the noise (p = 1 - 50 ln(2/δ_bin)/(ε² n)) and no bound holds
        # for a batch below it: 4,000 sits under the ~5,000 a shuffler gets from the demo's
        # 15,000 devices, less what randomized deletion removes. The release is the unbiased
        # count; Figure 1's truncation is beside it (docs/reproduction.md compares k-RR).
        params={"d": 8, "eps": 1.0, "delta": 1e-6, "n": 4000},
        min_crowd=50,
        **DELETION,
        min_fragments=1,  # every user sends its own message (Figure 2)
        max_fragments=16,
        delta=1e-6,
    ),
]
