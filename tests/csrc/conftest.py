import pytest


@pytest.fixture(scope="session")
def native_ext():
    """The CPU extension, built at most once per environment (cached under .cache/torch_extensions).

    A build failure fails these tests instead of skipping them: the fallback is tested separately.
    """
    from csrc.loader import unavailable_reason
    from models.llama.fused import load_ops

    lib = load_ops()
    assert lib is not None, f"native CPU extension unavailable: {unavailable_reason()}"
    return lib
