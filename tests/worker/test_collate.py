"""The default collate pads ragged token lists (Hugging Face datasets) with the right pad id."""

from __future__ import annotations

import pytest
import torch

from embedpipe.worker.collate import PadCollator

from ..frameworks import bert, offloaded, train_briefly


def ragged(n: int = 6) -> list[dict]:
    return [
        {"input_ids": list(range(5, 5 + 2 + i % 3)), "label": i % 2, "text": f"s{i}"}
        for i in range(n)
    ]


def test_lists_are_padded_masked_and_stacked():
    batch = PadCollator(pad_id=0)(ragged(3))
    assert batch["input_ids"].tolist() == [[5, 6, 0, 0], [5, 6, 7, 0], [5, 6, 7, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["label"].tolist() == [0, 1, 0]
    assert batch["text"] == ["s0", "s1", "s2"]


def test_token_labels_pad_with_the_ignored_index_and_a_mask_given_is_kept():
    samples = [
        {"input_ids": [5, 6], "attention_mask": [1, 1], "labels": [1, 2]},
        {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [1, 2, 3]},
    ]
    batch = PadCollator(pad_id=3)(samples)
    assert batch["input_ids"].tolist() == [[5, 6, 3], [5, 6, 7]]
    assert batch["labels"].tolist() == [[1, 2, -100], [1, 2, 3]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_ragged_ids_without_a_pad_id_say_how_to_give_one():
    with pytest.raises(ValueError, match=r"different lengths \(2 to 4\).*padding_idx="):
        PadCollator()(ragged(3))
    assert PadCollator()(ragged(1))["input_ids"].tolist() == [[5, 6]]  # nothing to pad


def test_a_tokenizers_pad_id_is_honoured(tmp_path):
    transformers = pytest.importorskip("transformers")
    words = ["[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]", *"abcdefgh"]
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(words)})
    assert tokenizer.pad_token_id == 4
    batch = PadCollator(tokenizer=tokenizer)(ragged(2))
    assert batch["input_ids"].tolist() == [[5, 6, 4], [5, 6, 7]]


def test_a_hugging_face_dataset_goes_through_the_loader_padded_with_the_models_padding_idx(
    tmp_path,
):
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(ragged(8))
    model = bert()
    with offloaded(model, tmp_path / "t.zarr") as pipe:
        batches = list(pipe.loader(dataset, batch_size=4, num_workers=2))
        assert batches[0]["input_ids"][0].tolist() == [5, 6, 0, 0]  # BERT's padding_idx is 0
        embeds = batches[0]["inputs_embeds"]
        assert torch.equal(embeds[0, 2], torch.from_numpy(pipe.table.read([0])[0]))  # the pad row
        assert embeds.shape == (4, 4, 32)


def test_hf_trainer_trains_on_a_ragged_dataset_with_no_collator(tmp_path):
    pytest.importorskip("transformers")
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_list(
        [{k: v for k, v in s.items() if k != "text"} for s in ragged(8)]
    )
    assert train_briefly(tmp_path, dataset, steps=2) == 2


def test_samples_of_one_length_are_stacked_as_they_are():
    samples = [{"input_ids": torch.tensor([5, 6, 7], dtype=torch.int32), "labels": [1, 2, 3]}] * 2
    batch = PadCollator(pad_id=0)(samples)
    assert (
        batch["input_ids"].dtype == torch.int32 and batch["input_ids"].tolist() == [[5, 6, 7]] * 2
    )
    assert batch["labels"].tolist() == [[1, 2, 3]] * 2 and "attention_mask" not in batch
