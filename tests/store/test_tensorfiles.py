"""Import from model files and export back, bit for bit; bad sources fail with a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import embedpipe
from embedpipe import errors


def test_hf_bert_folder_round_trips_bit_for_bit(tmp_path, bert_folder):
    folder, word_embeddings = bert_folder
    table = embedpipe.import_table(folder, tmp_path / "t.zarr", chunk_rows=96)
    assert table.metadata["source"]["key"] == "bert.embeddings.word_embeddings.weight"
    assert table.metadata["padding_idx"] == 0  # the config's pad_token_id, a pipe's default
    assert torch.equal(table.to_tensor(), word_embeddings)
    out = embedpipe.export_table(table.path, tmp_path / "out.safetensors")
    exported = load_file(out)
    assert list(exported) == ["weight"]
    assert torch.equal(exported["weight"], word_embeddings)
    assert exported["weight"].numpy().tobytes() == word_embeddings.numpy().tobytes()
    npy = embedpipe.export_table(table, tmp_path / "out.npy")
    assert np.load(npy).tobytes() == word_embeddings.numpy().tobytes()


def test_export_of_a_safetensors_import_is_the_same_tensor(tmp_path, bert_folder):
    folder, _word_embeddings = bert_folder
    src = load_file(folder / "model.safetensors")
    key = "bert.embeddings.word_embeddings.weight"
    table = embedpipe.import_table(folder / "model.safetensors", tmp_path / "t.zarr")
    embedpipe.export_table(table, tmp_path / "o.safetensors", key=key)
    assert torch.equal(load_file(tmp_path / "o.safetensors")[key], src[key])


def test_state_dict_and_npy_sources(tmp_path, bert_folder):
    folder, word_embeddings = bert_folder
    from transformers import BertModel

    model = BertModel.from_pretrained(folder)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    t = embedpipe.import_table(tmp_path / "model.pt", tmp_path / "pt.zarr")
    assert t.metadata["source"]["key"] == "embeddings.word_embeddings.weight"
    assert torch.equal(t.to_tensor(), word_embeddings)
    torch.save({"model": {"emb": word_embeddings}}, tmp_path / "nested.bin")
    t = embedpipe.import_table(tmp_path / "nested.bin", tmp_path / "n.zarr", key="model.emb")
    assert torch.equal(t.to_tensor(), word_embeddings)
    np.save(tmp_path / "w.npy", word_embeddings.numpy())
    t = embedpipe.import_table(tmp_path / "w.npy", tmp_path / "npy.zarr")
    assert torch.equal(t.to_tensor(), word_embeddings)


def test_pytorch_bin_model_folder(tmp_path, bert_folder):
    folder, word_embeddings = bert_folder
    bin_folder = tmp_path / "binmodel"
    bin_folder.mkdir()
    torch.save(load_file(folder / "model.safetensors"), bin_folder / "pytorch_model.bin")
    t = embedpipe.import_table(bin_folder, tmp_path / "t.zarr")
    assert torch.equal(t.to_tensor(), word_embeddings)


def test_sharded_safetensors_folder(tmp_path, weight):
    folder = tmp_path / "sharded"
    folder.mkdir()
    save_file(
        {"model.embed_tokens.weight": torch.from_numpy(weight)},
        folder / "model-00001-of-00002.safetensors",
    )
    save_file({"lm_head.weight": torch.zeros(3, 3)}, folder / "model-00002-of-00002.safetensors")
    index = {
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        }
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    t = embedpipe.import_table(folder, tmp_path / "t.zarr")
    assert torch.equal(t.to_tensor(), torch.from_numpy(weight))


def test_bfloat16_needs_a_dtype_and_casts_losslessly(tmp_path, weight):
    bf16 = torch.from_numpy(weight).to(torch.bfloat16)
    save_file({"wte.weight": bf16}, tmp_path / "bf.safetensors")
    with pytest.raises(errors.SourceFormatError, match="'wte.weight' is bfloat16.*--dtype float32"):
        embedpipe.import_table(tmp_path / "bf.safetensors", tmp_path / "t.zarr")
    assert not (tmp_path / "t.zarr").exists()
    t = embedpipe.import_table(tmp_path / "bf.safetensors", tmp_path / "t.zarr", dtype="float32")
    assert torch.equal(t.to_tensor(), bf16.float())


def test_ambiguous_and_missing_keys_list_the_candidates(tmp_path, weight):
    w = torch.from_numpy(weight)
    save_file(
        {"encoder.embed_tokens.weight": w, "decoder.embed_tokens.weight": w.clone()},
        tmp_path / "two.safetensors",
    )
    with pytest.raises(
        errors.SourceKeyError,
        match="decoder.embed_tokens.weight, encoder.embed_tokens.weight.*--key",
    ):
        embedpipe.import_table(tmp_path / "two.safetensors", tmp_path / "t.zarr")
    t = embedpipe.import_table(
        tmp_path / "two.safetensors", tmp_path / "t.zarr", key="decoder.embed_tokens.weight"
    )
    assert t.metadata["source"]["key"] == "decoder.embed_tokens.weight"
    save_file({"a": w, "b": w.clone()}, tmp_path / "none.safetensors")
    with pytest.raises(errors.SourceKeyError, match="no word-embedding tensor .* from: a, b"):
        embedpipe.import_table(tmp_path / "none.safetensors", tmp_path / "u.zarr")
    with pytest.raises(errors.SourceKeyError, match="no tensor named 'c'"):
        embedpipe.import_table(tmp_path / "none.safetensors", tmp_path / "u.zarr", key="c")


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.safetensors does not exist"):
        embedpipe.import_table(tmp_path / "missing.safetensors", tmp_path / "t.zarr")
    (tmp_path / "w.csv").write_text("1,2")
    with pytest.raises(errors.SourceFormatError, match="unknown file type '.csv'"):
        embedpipe.import_table(tmp_path / "w.csv", tmp_path / "t.zarr")
    (tmp_path / "junk.safetensors").write_bytes(b"\x01")
    with pytest.raises(errors.SourceFormatError, match="not a readable safetensors file"):
        embedpipe.import_table(tmp_path / "junk.safetensors", tmp_path / "t.zarr")
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(errors.SourceFormatError, match="torch.load could not read it"):
        embedpipe.import_table(tmp_path / "junk.pt", tmp_path / "t.zarr")
    np.save(tmp_path / "v.npy", np.zeros(5, np.float32))
    with pytest.raises(errors.SourceFormatError, match=r"shape \[5\]; .* 2-D"):
        embedpipe.import_table(tmp_path / "v.npy", tmp_path / "t.zarr")
    np.save(tmp_path / "i.npy", np.zeros((5, 2), np.int64))
    with pytest.raises(errors.SourceFormatError, match="dtype int64 is not floating point"):
        embedpipe.import_table(tmp_path / "i.npy", tmp_path / "t.zarr")
    (tmp_path / "empty_model").mkdir()
    with pytest.raises(errors.SourceFormatError, match="no model.safetensors"):
        embedpipe.import_table(tmp_path / "empty_model", tmp_path / "t.zarr")
    assert not (tmp_path / "t.zarr").exists()


def test_export_refuses_bad_targets_and_leaves_nothing(table, tmp_path):
    with pytest.raises(errors.SourceFormatError, match="not '.csv'"):
        embedpipe.export_table(table, tmp_path / "o.csv")
    (tmp_path / "o.npy").write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="o.npy already exists"):
        embedpipe.export_table(table, tmp_path / "o.npy")
    assert (tmp_path / "o.npy").read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.npy", "t.zarr"]
