"""Every ```python snippet of README.md runs as printed. Snippets that use a model get the names a
reader would have (``model``, ``input_ids``, ``attention_mask``) bound to a tiny random Qwen3;
everything else they use they must define themselves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.S | re.M)

pytestmark = pytest.mark.filterwarnings("error::FutureWarning")


def test_the_readme_has_snippets():
    assert len(SNIPPETS) >= 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs(index):
    code = SNIPPETS[index]
    names = {"__name__": f"readme_snippet_{index}"}
    if re.search(r"\bmodel\b", code):
        pytest.importorskip("transformers")
        from minipaged_ops.integration import _compat
        from minipaged_ops.tiny import ragged_batch, tiny_model

        if _compat.CACHE_ARGUMENT != "cache" and "cache=cache" in code:
            pytest.skip("the README shows transformers >= 5.24's `cache=` argument")
        model = tiny_model("qwen3")
        input_ids, attention_mask = ragged_batch([5, 9], vocab=model.config.vocab_size)
        names.update(model=model, input_ids=input_ids, attention_mask=attention_mask)
    with torch.no_grad():
        exec(compile(code, f"README.md snippet {index}", "exec"), names)
