"""The impl rewrite's reading of a legacy ``forward``'s annotations."""

from __future__ import annotations

import libcst as cst
import pytest

from vllm.migrate.impl import admits_none


@pytest.mark.parametrize(("annotation", "expected"), [
    ("torch.Tensor | None", True),
    ("None | torch.Tensor", True),
    ("Optional[torch.Tensor]", True),
    ("typing.Optional[torch.Tensor]", True),
    ("Union[torch.Tensor, None]", True),
    ("'torch.Tensor | None'", True),
    ("None", True),
    ("torch.Tensor", False),
    ("Union[torch.Tensor, int]", False),
    ("list[torch.Tensor | None]", False),
    ("Any", False),  # the new forward's None still reaches code typed for a tensor
    ("'not an expression ('", False),
])
def test_admits_none(annotation: str, expected: bool) -> None:
    assert admits_none(cst.parse_expression(annotation)) is expected
