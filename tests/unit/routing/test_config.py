import pytest
from pydantic import ValidationError

from serve_app.routing.config import RoutingConfig


def test_a_pool_shares_a_device_with_its_group_only() -> None:
    config = RoutingConfig(colocated=[["a", "b"], ["c", "d"]])
    assert config.sharing("a") == {"a", "b"}
    assert config.sharing("d") == {"c", "d"}
    assert config.sharing("e") == {"e"}


def test_a_pool_in_two_colocated_groups_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"colocated names \['b'\] in more than one group"):
        RoutingConfig(colocated=[["a", "b"], ["b", "c"]])
