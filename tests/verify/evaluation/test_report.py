"""The evaluation plots: a colour per method from its name, figures that fit a screen, rows without per-depth counts."""

from __future__ import annotations

import matplotlib.image
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from draftsmith.verify.evaluation.report import FAMILY_PALETTES, PLAIN_COLOR, method_color, method_family, plot_acceptance, plot_domains

DEMO_METHODS = [
    "plain",
    "ngram",
    "ngram_tree",
    "suffix",
    "suffix+ngram",
    "demo_draft",
    "medusa",
    "eagle1",
    "eagle2",
    "eagle3",
    "mtp",
    "suffix+draft",
    "hf_prompt_lookup[ngram]",
    "hf_assisted[demo_draft]",
]
DEMO_DOMAINS = ["code", "prose", "copy", "long", "repeat", "mixed/code", "mixed/prose", "mixed/repeat"]


def fake_row(domain: str, method: str, seed: int = 0) -> dict:
    """A row with the keys the plots read, as ``summarise`` makes it: peers have no per-depth counts, plain never drafts."""
    row = {"domain": domain, "method": method, "tau": 1.0, "speedup": 1.0, "acceptance_by_depth": None, "reached_by_depth": None}
    if method == "plain":
        return row | {"acceptance_by_depth": {"given_reached": [], "given_drafted": [], "per_step": []}, "reached_by_depth": []}
    row |= {"tau": 1.5 + seed % 7 * 0.4, "speedup": 0.5 + seed % 5 * 0.4}
    if method.startswith("hf_"):
        return row
    rates = [0.9 - 0.05 * d for d in range(6)] + [None]  # a depth drafted but never reached has no rate
    reached = [120 // (d + 1) for d in range(7)]  # the deep depths fall under FEW_STEPS
    return row | {"acceptance_by_depth": {"given_reached": rates, "given_drafted": rates, "per_step": rates}, "reached_by_depth": reached}


def demo_rows(domains: list[str] = DEMO_DOMAINS, methods: list[str] = DEMO_METHODS) -> list[dict]:
    return [fake_row(d, m, seed=i * 3 + j) for i, d in enumerate(domains) for j, m in enumerate(methods)]


def drawn_colors(monkeypatch, plot, rows, tmp_path) -> dict[str, str]:
    """The colour each method's bars or lines are drawn in, read off the figure ``plot`` saves."""
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: figures.append(fig))
    plot(rows, tmp_path / "plot.png")
    colors = {}
    for ax in figures[0].axes:
        colors |= {bars.get_label(): to_hex(bars.patches[0].get_facecolor()) for bars in ax.containers if bars.patches}
        colors |= {line.get_label(): to_hex(line.get_color()) for line in ax.lines if not line.get_label().startswith("_")}
    return colors


@pytest.mark.parametrize("plot", [plot_domains, plot_acceptance])
def test_a_method_keeps_its_colour_whatever_else_is_drawn(monkeypatch, tmp_path, plot):
    alone = drawn_colors(monkeypatch, plot, demo_rows(["code"], ["plain", "eagle3", "my_method"]), tmp_path)
    crowded = drawn_colors(monkeypatch, plot, demo_rows(), tmp_path)
    reordered = drawn_colors(monkeypatch, plot, demo_rows(DEMO_DOMAINS[::-1], DEMO_METHODS[::-1]), tmp_path)
    assert alone["eagle3"] == crowded["eagle3"] == reordered["eagle3"] == method_color("eagle3")
    assert alone["my_method"] == method_color("my_method")
    assert crowded == reordered


def test_an_unknown_name_gets_a_colour_from_a_stable_hash_not_from_hash():
    # pinned: Python's hash() of a str changes between runs, crc32 does not
    assert method_color("my_method") == "#c49c94"
    assert method_color("ngram_k8") == "#4d9221" and method_family("ngram_k8") == "lookup"
    assert method_color("hf_assisted[eagle3]") in FAMILY_PALETTES["peers"]


def test_each_family_has_its_hue_and_plain_is_neutral():
    assert method_color("plain") == PLAIN_COLOR
    red, green, blue = (int(PLAIN_COLOR[i : i + 2], 16) for i in (1, 3, 5))
    assert red == green == blue  # a grey, no hue
    families = {
        "lookup": ["ngram", "ngram_tree", "suffix", "suffix+ngram"],
        "draft": ["demo_draft", "draft_small", "suffix+draft"],
        "heads": ["medusa", "eagle1", "eagle2", "eagle3", "mtp", "dflash"],
        "peers": ["hf_prompt_lookup[ngram]", "hf_assisted[demo_draft]"],
    }
    for family, names in families.items():
        for name in names:
            assert method_family(name) == family, name
            assert method_color(name) in FAMILY_PALETTES[family], name


def test_the_demo_methods_never_share_a_colour():
    colors = [method_color(m) for m in DEMO_METHODS]
    assert len(set(colors)) == len(DEMO_METHODS)


@pytest.mark.parametrize("num_domains", [8, 17])  # 17 wrap into rows: taller, never wider
@pytest.mark.parametrize("plot", [plot_domains, plot_acceptance])
def test_the_plots_fit_a_screen_for_14_methods(tmp_path, plot, num_domains):
    path = tmp_path / "plot.png"
    plot(demo_rows([f"domain{i}" for i in range(num_domains)]), path)
    height, width, _ = matplotlib.image.imread(path).shape
    assert width <= 1600, (width, height)


def test_rows_without_per_depth_counts_do_not_break_plot_acceptance(tmp_path):
    peers_and_plain = demo_rows(["code"], ["plain", "hf_prompt_lookup[ngram]", "hf_assisted[demo_draft]"])
    plot_acceptance(peers_and_plain, tmp_path / "none.png")
    plot_acceptance(peers_and_plain + demo_rows(["prose"], ["eagle3"]), tmp_path / "some.png")
    assert matplotlib.image.imread(tmp_path / "none.png").size and matplotlib.image.imread(tmp_path / "some.png").size
