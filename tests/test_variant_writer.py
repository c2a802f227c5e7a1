"""The variant writer keeps at most WRITE_BACK_BYTES of its output in the page cache and writes every value."""

from __future__ import annotations

import torch
from page_cache import resident_fraction, skip_where_synced_pages_stay
from safetensors import safe_open

from quantize import variant_writer


def test_the_writer_drops_what_it_wrote_as_it_goes_and_every_tensor_reads_back(tmp_path, monkeypatch):
    skip_where_synced_pages_stay(tmp_path)
    monkeypatch.setattr(variant_writer, "WRITE_BACK_BYTES", 1 << 20)
    torch.manual_seed(0)
    tensors = {f"layer.{i}.weight": torch.randint(-128, 127, (1024, 1024), dtype=torch.int8) for i in range(12)}
    specs = {name: ("I8", tuple(t.shape)) for name, t in tensors.items()}
    path = tmp_path / "model.safetensors"
    most = 0.0
    with variant_writer.open_variant_file(path, specs, {"format": "pt"}) as writer:
        for name, tensor in tensors.items():
            for half in tensor.chunk(2):  # half a tensor at a time, as a streamed build writes row blocks
                writer.write_part(name, half, 0 if half.data_ptr() == tensor.data_ptr() else half.numel())
            most = max(most, resident_fraction(path))
    # 12 MB written; never more than the 1 MB window and one half-tensor unsynced (plus the header's page)
    assert most <= 2.5 / 12
    assert resident_fraction(path) < 0.1
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(handle.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor)
