"""A hub that stops answering once training has begun: rank 0's upload ends at its deadline, the launcher returns,
the model stays saved and the one line names the `hf upload` command (tests/unit/compat/test_hub_deadline.py
has every call site; this is the whole run, once)."""

from __future__ import annotations

import threading

import pytest
from conftest import launch, quick
from helpers.fake_hub import NotServed, serve

pytestmark = pytest.mark.slow


def test_a_hub_silent_at_the_upload_fails_it_and_the_launch_returns_with_the_model_saved(tmp_path):
    out = tmp_path / "run"
    release = threading.Event()
    with serve(tmp_path / "hub") as hub:
        answer = hub.handle

        # whoami is answered before training; the upload's first request never is
        def handle(method, path, *rest):
            if path == "/api/repos/create":
                release.wait()
                raise NotServed
            return answer(method, path, *rest)

        hub.handle = handle
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_TOKEN": hub.token,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_OFFLINE": "0",
            "HF_HUB_DOWNLOAD_TIMEOUT": "2",
            "NO_PROXY": "127.0.0.1",
            "HF_HOME": str(tmp_path / "hf_home"),
        }
        try:
            proc = launch(
                "accelerate_configs/zero3.yaml",
                *quick(max_steps="2"),
                "--output_dir",
                str(out),
                "--push_to_hub",
                "true",
                "--hub_model_id",
                "tester/tiny",
                env=env,
                check=False,
            )
        finally:
            release.set()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("train_fsdp.py: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert (
        "the model is saved, but its upload to tester/tiny failed (ReadTimeout: no answer within the deadline"
        in (errors[0])
    )
    assert f"`hf upload tester/tiny {out / 'model'}`" in errors[0], errors[0]
    assert (out / "model" / "config.json").is_file() and ("POST", "/api/repos/create") in hub.requests
