"""Every byte --push_to_hub uploads goes through huggingface_hub's HTTP client, where each wait has the deadline
(fsdp_recipes.compat.hub_deadline; a silent hub: tests/unit/compat/test_hub_deadline.py), also where hf_xet is
installed: the large files, which the hub wants over LFS or Xet, go up over LFS, never through hf_xet, whose upload
of a commit's shard waits for the hub's answer with no timeout. The hub is tests/helpers/fake_hub.py, taught here the
LFS batch and upload routes, served to the real huggingface_hub client."""

from __future__ import annotations

import base64
import importlib.util
import json
import re

import huggingface_hub.constants
import pytest
import torch
from helpers.fake_hub import serve
from safetensors.torch import save_file

from fsdp_recipes.config.hub_push import HubPush
from fsdp_recipes.train.upload import upload_final_model

LFS_BATCH = re.compile(r"/(\w+/[\w.-]+)\.git/info/lfs/objects/batch")
LFS_PUT = re.compile(r"/lfs-upload/([0-9a-f]{64})")
COMMIT = re.compile(r"/api/models/[\w-]+/[\w.-]+/commit/[^/]+")
PREUPLOAD = re.compile(r"/api/models/[\w-]+/[\w.-]+/preupload/[^/]+")


@pytest.fixture
def lfs_hub(tmp_path, monkeypatch):
    """The fake hub, asking for LFS (as the real hub does) for every .safetensors file: the batch route hands out an
    upload URL on the same server, the PUT there keeps the bytes, and the commit's lfsFile lines become those files."""
    with serve(tmp_path / "hub") as hub:
        answer, hub.received = hub.handle, {}

        def handle(method, path, query, body, authorized):
            if method == "POST" and PREUPLOAD.fullmatch(path):
                files = json.loads(body)["files"]
                return {
                    "files": [
                        {
                            "path": f["path"],
                            "uploadMode": "lfs" if f["path"].endswith(".safetensors") else "regular",
                            "shouldIgnore": False,
                        }
                        for f in files
                    ]
                }
            if method == "POST" and LFS_BATCH.fullmatch(path):
                assert authorized
                objects = json.loads(body)["objects"]
                return {
                    "transfer": "basic",
                    "objects": [
                        {**o, "actions": {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}} for o in objects
                    ],
                }
            if method == "PUT" and (put := LFS_PUT.fullmatch(path)):
                hub.received[put.group(1)] = body
                return {}
            # lfsFile lines: the bytes the PUT brought
            if method == "POST" and COMMIT.fullmatch(path):
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                for line in lines:
                    if line.get("key") == "lfsFile":
                        content = hub.received[line["value"]["oid"]]
                        line["key"] = "file"
                        line["value"] = {
                            "path": line["value"]["path"],
                            "encoding": "base64",
                            "content": base64.b64encode(content).decode(),
                        }
                body = "\n".join(json.dumps(line) for line in lines).encode()
            return answer(method, path, query, body, authorized)

        hub.handle = handle
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)
        # hf_xet would be used
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)
        monkeypatch.setenv("HF_TOKEN", hub.token)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        yield hub


# model weights in one file or sharded, and a LoRA adapter beside: each .safetensors file goes over LFS
FOLDERS = {
    "one weights file": {"model/model.safetensors": 64},
    "shards": {"model/model-00001-of-00002.safetensors": 40, "model/model-00002-of-00002.safetensors": 24},
    "model and adapter": {"model/model.safetensors": 64, "adapter/adapter_model.safetensors": 8},
}


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_weights_go_up_over_http_not_hf_xet(tmp_path, lfs_hub, folder):
    assert importlib.util.find_spec("hf_xet") is not None, "hf_xet is not installed: nothing here would use it"
    out = tmp_path / "run"
    expected = {}
    for name, rows in FOLDERS[folder].items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({"weight": torch.randn(rows, 16)}, out / name)
        expected[name.split("/", 1)[1] if name.startswith("model/") else name] = (out / name).read_bytes()
    (out / "model" / "config.json").write_text("{}")
    if (out / "adapter").is_dir():
        (out / "adapter" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))

    upload_final_model(HubPush("tester/pushed"), str(out), step=2, log=lambda line: None)

    xet = [request for request in lfs_hub.requests if "xet" in request[1].lower()]
    assert xet == [] and lfs_hub.unhandled == [], (xet, lfs_hub.unhandled)
    # each file's bytes, in one PUT
    assert sorted(lfs_hub.received.values()) == sorted(expected.values())
    repo = lfs_hub.repo_folder("tester/pushed")
    assert {name: (repo / name).read_bytes() for name in expected} == expected
    # for this upload only
    assert huggingface_hub.constants.HF_HUB_DISABLE_XET is False
