"""The HTML report: its parts for the bundled GPT and Llama at tp=8, and the page in a real
headless browser (Debian's chromium)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

import shardplan
from shardplan.report.html import render_html
from shardplan.models import build

CHROMIUM = "/usr/bin/chromium"
needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is absent (Debian: apt-get install -y chromium)")

# model, list path, blocks, bytes of one f/g all-reduce, a blocked/sharded layout drawn
CASES = {
    "gpt-8.3b": ("transformer.h", "h", 72, "192.00 KiB", "S(0|3072+3072+3072)"),
    "llama-70b": ("layers", "layers", 80, "512.00 KiB", "S(0)"),
}


@pytest.fixture(scope="module")
def plans():
    return {name: shardplan.plan(build(name, device="meta"), 8) for name in CASES}


@pytest.fixture(scope="module")
def pages(plans):
    return {name: render_html(p) for name, p in plans.items()}


def _count(html: str, pattern: str) -> int:
    return len(re.findall(pattern, html))


@pytest.mark.parametrize("name", list(CASES))
def test_page_has_blocks_legend_memory_warnings_and_collectives(name, plans, pages):
    plan, page = plans[name], pages[name]
    path, label, n, gbytes, layout = CASES[name]
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # self-contained: nothing fetched
    for needle in ("http://", "https://", "<link", " src=", "@import", "url("):
        assert needle not in page, needle
    # warnings come first, and say there are none
    assert page.index('id="warnings"') < page.index('id="memory"') < page.index('id="blocks"')
    assert 'data-count="0"' in page and "No warnings" in page
    # the legend names every layout category
    legend = page[page.index('id="legend"'):page.index("</section>", page.index('id="legend"'))]
    for cat in ("replicated", "column", "row", "vocab", "partial"):
        assert f'data-cat="{cat}"' in legend
    # memory bar: per rank against unsharded
    m = plan.memory
    assert f'data-per-rank="{m.param_bytes_per_rank}" data-unsharded="{m.param_bytes_unsharded}"' in page
    assert "(12.5%)" in page
    # identical blocks drawn once, labelled with their range and count
    assert _count(page, r'class="mod repeated') == 1
    assert f'data-count="{n}" data-first="0" data-last="{n - 1}"' in page
    assert f"{label} 0–{n - 1}</span>" in page and f"×{n}</span>" in page
    assert f"{path}.{{0–{n - 1}}}" in page
    # the drawn block has each sharded layout, coloured
    assert f'data-layout="{layout}"' in page
    assert _count(page, r'class="chip param cat-column"') >= 2
    assert _count(page, r'class="chip param cat-row"') >= 2
    assert _count(page, r'class="chip param cat-vocab"') >= 1
    assert _count(page, r'class="chip out cat-partial"') >= 2  # row outputs before g
    # communication points: f before and g after each region, with kind, direction, bytes
    f_points = re.findall(r'<div class="comm-point f" data-purpose="f" data-kind="all_reduce" '
                          r'data-direction="backward" data-bytes="(\d+)"', page)
    g_points = re.findall(r'<div class="comm-point g" data-purpose="g" data-kind="all_reduce" '
                          r'data-direction="forward" data-bytes="(\d+)"', page)
    assert len(f_points) == 3 and len(g_points) == 3  # in a block: 2 each; the head's f; the embedding's g
    assert f"<b>{gbytes}</b>" in page and f"×{n} blocks" in page
    assert 'data-purpose="gather_output" data-kind="all_gather"' in page
    # the rule behind decisions: on hover, and in the data the details panel reads
    assert "rule: open: column parallel" in page
    assert "vocab-parallel embedding" in page
    assert 'id="plan-data" type="application/json"' in page
    # the page stays small: the repeated blocks are not drawn 72/80 times
    assert len(page) < 150_000


def test_warnings_are_listed_first_and_escaped(plans):
    plan = plans["gpt-8.3b"].model_copy(update={"warnings": [
        "linear_9 (aten.linear.default in transformer.h.3.mlp.c_fc) kept replicated: <no rule> & more",
        "second warning"]})
    page = render_html(plan)
    section = page[page.index('id="warnings"'):page.index("</section>", page.index('id="warnings"'))]
    assert 'data-count="2"' in section and "2 warnings" in section
    assert "&lt;no rule&gt; &amp; more" in section and "<no rule>" not in page
    assert page.index('id="warnings"') < page.index('id="memory"')


def test_blocks_that_differ_are_drawn_apart(plans):
    """Change one block's layout: that block is drawn alone between two collapsed runs."""
    plan = plans["llama-70b"]
    params = [p.model_copy(update={"layout": "R", "local_shape": p.global_shape})
              if p.name == "layers.5.attention.wq.weight" else p for p in plan.params]
    page = render_html(plan.model_copy(update={"params": params}))
    assert 'data-count="5" data-first="0" data-last="4"' in page
    assert 'data-count="74" data-first="6" data-last="79"' in page
    assert "layers 5</span>" in page


def test_small_plan_with_loss_padding_and_model_level_items():
    import torch
    model = build("gpt-tiny", vocab_size=97)
    idx = torch.randint(0, 97, (2, 8))
    page = render_html(shardplan.plan(model, 2, example_inputs=(idx, idx)))
    assert 'data-layout="S(0|pad98)"' in page
    assert 'data-purpose="vocab_loss"' in page and "model level" in page
    assert "tied" in page  # lm_head.weight is transformer.wte.weight


# --------------------------------------------------------------------------- a real browser

def _dump_dom(html: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "plan.html")
        with open(path, "w") as f:
            f.write(html)
        profile = os.path.join(d, "profile")
        out = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={profile}", "--dump-dom", f"file://{path}"],
            capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@needs_chromium
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_page_renders_in_headless_chromium(name, pages):
    dom = _dump_dom(pages[name])
    assert 'id="js-error"' not in dom, re.search(r'id="js-error"[^<]*', dom).group(0)
    assert 'data-rendered="1"' in dom  # the script ran to its end
    # the script built the details panel for the first column-parallel block
    assert 'class="detail-card"' in dom
    panel = dom[dom.index('id="details"'):]
    assert "open: column parallel" in panel and "stands for" in panel
    assert 'class="row cat-column selected"' in dom


@needs_chromium
@pytest.mark.timeout(120)
def test_browser_check_sees_script_errors(pages):
    """The error hook works: a page whose script throws shows #js-error in the DOM."""
    broken = pages["gpt-8.3b"].replace("</body>", "<script>undefinedFunction();</script></body>")
    dom = _dump_dom(broken)
    assert 'id="js-error"' in dom and "undefinedFunction" in dom
