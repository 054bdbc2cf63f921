"""The reconstruction pass with every chunk's queries placed where a full repeat of the context would put them
(issue 18, session 18; diagnosis only). The pass feeds each chunk at the same positions right after the cache, so
chunk k is copied from a distance ~T - 512 k: the last band from the nearest, where every token's copy attention is
high and a fact's does not stand out (own_rank.py). Here a forward pre-hook shifts the pass's position ids by the
chunk's start (minus its lead-in), so the chunk's token i sits at T + P + s + i as in one full repeat and every
chunk is copied from the same distance; then results/issue18-s17dev/band_profile.py's report (its arguments).
    python results/issue18-s18/aligned_rank.py --preset kvzip-copy-heads-lead --kind number --depth 0.9 --sample 1 --seed 0"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "issue18-s17dev"))
import band_profile  # noqa: E402
import kvcompress.hf.reconstruct as rc  # noqa: E402

LEAD = 32  # kvzip-copy-heads-lead's (PASS_LEAD)
current = {}
real_init = rc._Pass.__init__


def init(self, *args, **kwargs):
    real_init(self, *args, **kwargs)
    current["pass"] = self


def shift(module, args, kwargs):
    if module.config._attn_implementation != rc.ATTN_NAME or "pass" not in current:
        return None
    run = current["pass"]
    s = run.start  # set before the forward
    kwargs["position_ids"] = kwargs["position_ids"] + (s - min(LEAD, s))
    return args, kwargs


real_load = band_profile.load_model


def load_model(*args, **kwargs):
    model, tok = real_load(*args, **kwargs)
    model.model.register_forward_pre_hook(shift, with_kwargs=True)
    return model, tok


rc._Pass.__init__, band_profile.load_model = init, load_model
band_profile.main()
