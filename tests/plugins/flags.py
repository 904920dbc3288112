"""Variants of sample_nll that each declare one more flag of its plug-in (objectives/registry.py
``Plugin``), to check that the run reads the flag alike whether the plug-in is named by
``loss.name`` or passed to ``train(loss=...)`` (tests/distributed/test_api.py)."""

from __future__ import annotations

from paratrain.objectives.registry import Plugin
from tests.plugins.sample_nll import WHOLE_ROWS, SampleNLL


class ReferenceNLL(SampleNLL):
    """sample_nll that asks for the reference its plug-in's config key names (GRPO's: rl.reference)."""

    frozen = ("reference",)

    def attach(self, world) -> None:
        self.reference = world.reference()  # built from rl.reference, never from preference.reference


def _nll(cfg, **_):
    return SampleNLL()


# The memory estimate and the gradient-noise probe do not price it: refused beside them.
unpriced = Plugin("sample_nll_unpriced", objective=_nll, refuses=WHOLE_ROWS, priced=False)
# Its reference is rl.reference's.
rl_reference = Plugin(
    "sample_nll_rl_reference", objective=lambda cfg, **_: ReferenceNLL(), refuses=WHOLE_ROWS, reference="rl.reference"
)
