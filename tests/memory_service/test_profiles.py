import dataclasses

import pytest

from inferscale_kv.profile import kv_profile_id
from memory_service.errors import InvalidArgument
from memory_service.validation import validate_profile


@dataclasses.dataclass
class Profile:
    model: str = "smollm2-135m"
    model_hash: str = "m1"
    kv_dtype: str = "float32"
    tokenizer_hash: str = "t1"
    header_hash: str = "h1"
    recipe: str = "chunked-rope-cwe"
    recipe_version: int = 1
    context_window: int = 0
    max_context_tokens: int = 8192
    profile_id: str = ""


def test_changing_any_byte_relevant_field_changes_the_profile_id() -> None:
    reference = kv_profile_id(Profile())
    changes = dict(
        model="other", model_hash="m2", kv_dtype="fp8_e4m3", tokenizer_hash="t2", header_hash="h2",
        recipe="other", recipe_version=2, context_window=20, max_context_tokens=4096,
    )
    for field, value in changes.items():
        assert kv_profile_id(dataclasses.replace(Profile(), **{field: value})) != reference, field


def test_profile_with_a_stale_id_is_rejected() -> None:
    profile = Profile()
    profile.profile_id = kv_profile_id(profile)
    assert validate_profile(profile) == profile.profile_id
    profile.context_window = 5
    with pytest.raises(InvalidArgument, match="profile.profile_id"):
        validate_profile(profile)


def test_unknown_kv_dtype_is_rejected() -> None:
    profile = Profile(kv_dtype="int3")
    profile.profile_id = kv_profile_id(profile)
    with pytest.raises(InvalidArgument, match="kv_dtype"):
        validate_profile(profile)


def test_a_negative_window_cap_is_rejected() -> None:
    profile = Profile(max_context_tokens=-1)
    profile.profile_id = kv_profile_id(profile)
    with pytest.raises(InvalidArgument, match="max_context_tokens"):
        validate_profile(profile)
