"""benchmarks/moe_decode_floor.py: its candidate decode and its source edits of the Gluon kernels (the timing needs
an sm_90 GPU)."""
import pytest

from kernel_checks import REPO, check_e2m1_decode

try:
    from k3deploy.plugins.moe import kernels_gluon  # noqa: F401  (the floor script's decode builds on it)
    HAS_GLUON = True
except ImportError:
    HAS_GLUON = False


@pytest.mark.skipif(not HAS_GLUON, reason="this Triton has no Gluon (triton.experimental.gluon)")
def test_relaid_candidate_decodes_e2m1_and_every_variant_edits_the_kernels(monkeypatch):
    """The `dec14` candidate (10 integer instructions per 8 weights instead of 13, on words re-laid by `relay_word`)
    gives output i = (n_i, n_{i+4}) x the E8M0 factor like the shipped decode; and each of the script's variants
    really edits the kernels' source (or it would time the unchanged kernels under another name)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import moe_decode_floor as fl

    check_e2m1_decode(fl.dq_asm14, fl.relay_word)
    src = (REPO / "plugins/moe/kernels_gluon.py").read_text()
    assert tuple(fl._edits()) == fl.VARIANTS      # the CLI's variant names (checked without Triton) = the edits
    for name, edits in fl._edits().items():      # each edit applies exactly once; a moved decode is one clear error
        assert fl.edit_source(src, edits) != src, name
        with pytest.raises(ValueError, match="occurs 0 times.*update moe_decode_floor._edits"):
            fl.edit_source(src.replace(edits[-1][0], "moved"), edits)
