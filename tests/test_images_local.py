"""The store's local names (docs/images.md, "Offline images" and "Built images"): an image a
builder makes is rebuilt when its recipe changed (a node keeps no image from an older
builder), tags of one recipe share one build, and ``localhost/NAME`` names what was built on
this node, never anything from a registry. Real builders, skopeo and umoci; busybox only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ray_sandbox.runtime.errors import ImageNotFoundError, ImageReferenceError
from ray_sandbox.runtime.images import ImageStore, Transport, parse_reference, store
from ray_sandbox.runtime.images.storedir import ref_key
from tests.fx_images import assert_store_clean, busybox_variant


def plant_old_record(temp_store: ImageStore, ref: str, layout: Path) -> str:
    """What a node that ran an older ray_sandbox holds for ``ref``: a record without a recipe
    pointing at the image the older builder made (here a busybox variant). Returns its
    digest."""
    old = temp_store.get(f"oci:{layout}:old")
    key = ref_key(ref, str(temp_store.platform))
    record = {"ref": ref, "platform": str(temp_store.platform), "digest": old.digest,
              "source_digest": None}
    (temp_store.root / "refs" / f"{key}.json").write_text(json.dumps(record))
    temp_store.remove(f"oci:{layout}:old")  # only untags: the planted record names it
    return old.digest


def test_an_image_from_an_older_builder_is_rebuilt(temp_store: ImageStore, tmp_path: Path):
    layout = tmp_path / "oci"
    busybox_variant(layout, "old", marker="older-builder")
    old = plant_old_record(temp_store, "ray-sandbox/busybox:latest", layout)
    assert temp_store.inspect("ray-sandbox/busybox").digest == old  # what the node had
    image = temp_store.get("ray-sandbox/busybox")
    assert image.digest != old
    assert not (image.rootfs / "etc" / "variant").exists()  # today's builder made it
    assert temp_store.get("ray-sandbox/busybox").digest == image.digest  # then cached
    assert temp_store.prune() == [old]  # the old image is left dangling, like a moved tag
    temp_store.remove("ray-sandbox/busybox")
    assert_store_clean(temp_store)


def test_tags_of_one_recipe_share_one_build(temp_store: ImageStore,
                                            monkeypatch: pytest.MonkeyPatch):
    recipe = store.LOCAL_IMAGES["ray-sandbox/busybox:latest"]
    monkeypatch.setitem(store.LOCAL_IMAGES, "ray-sandbox/busybox:1", recipe)
    first = temp_store.get("ray-sandbox/busybox:1")
    monkeypatch.setattr(recipe, "build", None)  # a second build would fail
    second = temp_store.get("ray-sandbox/busybox:latest")
    assert second.digest == first.digest and second.ref == "ray-sandbox/busybox:latest"
    assert {i.ref for i in temp_store.list()} == {"ray-sandbox/busybox:1",
                                                   "ray-sandbox/busybox:latest"}


def test_the_python_tags_on_offer():
    assert store.LOCAL_IMAGES["ray-sandbox/python:latest"] is \
        store.LOCAL_IMAGES["ray-sandbox/python:3.11"]
    assert "ray-sandbox/python:3.13" in store.LOCAL_IMAGES
    assert store.LOCAL_IMAGES["ray-sandbox/python:3.13"].recipe != \
        store.LOCAL_IMAGES["ray-sandbox/python:3.11"].recipe


@pytest.mark.parametrize(("text", "normalized"), [
    ("localhost/app", "localhost/app:latest"),
    ("localhost/lab/task:v1", "localhost/lab/task:v1"),
])
def test_localhost_names_are_node_builds(text: str, normalized: str):
    ref = parse_reference(text)
    assert ref.transport is Transport.LOCAL and str(ref) == normalized
    assert ref.built_here and ref.reads_host_files  # the service refuses them for tenants
    assert parse_reference(str(ref)) == ref
    for registry in (f"docker://{text}", "localhost:5000/app"):  # a registry, as written
        assert parse_reference(registry).transport is Transport.DOCKER
    with pytest.raises(ImageReferenceError, match="by tag"):
        parse_reference(f"{text}@sha256:{'ab' * 32}")
    assert not parse_reference("ray-sandbox/python").reads_host_files


def test_tag_names_a_stored_image_on_this_node(temp_store: ImageStore, tmp_path: Path):
    layout = tmp_path / "oci"
    busybox_variant(layout, "v", marker="tagged")
    image = temp_store.get(f"oci:{layout}:v")
    named = temp_store.tag(image.digest, "lab/task:v1")
    assert named.ref == "localhost/lab/task:v1" and named.digest == image.digest
    assert temp_store.get("localhost/lab/task:v1").digest == image.digest
    assert temp_store.tag(f"oci:{layout}:v", "localhost/lab/task:v2").digest == image.digest
    for bad in ("ghcr.io/a/b", "localhost:5000/x", "ray-sandbox/python", "docker://localhost/x",
                f"oci:{layout}:v"):
        with pytest.raises(ImageReferenceError, match="localhost/"):
            temp_store.tag(image.digest, bad)
    with pytest.raises(ImageNotFoundError):
        temp_store.tag("sha256:" + "ab" * 32, "localhost/x")
    with pytest.raises(ImageNotFoundError, match="built on this node"):
        temp_store.get("localhost/lab/absent:v1")
    temp_store.remove(f"oci:{layout}:v")
    temp_store.remove("localhost/lab/task:v1")
    assert temp_store.get("localhost/lab/task:v2").digest == image.digest
    temp_store.remove("localhost/lab/task:v2")
    assert_store_clean(temp_store)
