"""The public surface: a sorted, explicit __all__ whose names all exist (httpx's exported-members test)."""

import embedpipe


def test_all_is_sorted_and_complete():
    assert embedpipe.__all__ == sorted(embedpipe.__all__)
    assert embedpipe.__all__ == [
        "ConvertedShard",
        "EmbeddedBatch",
        "EmbeddingPipe",
        "Table",
        "collate",
        "convert",
        "errors",
        "export_table",
        "hf",
        "import_table",
        "optim",
    ]
    for name in embedpipe.__all__:
        assert getattr(embedpipe, name) is not None


def test_errors_subclass_the_builtins_they_mean():
    e = embedpipe.errors
    assert issubclass(e.IdOutOfRangeError, ValueError) and issubclass(
        e.IdOutOfRangeError, IndexError
    )
    assert issubclass(e.TableNotFoundError, FileNotFoundError)
    assert issubclass(e.TableExistsError, FileExistsError)
    assert issubclass(e.ReadOnlyTableError, PermissionError)
    assert issubclass(e.NonFiniteGradientError, FloatingPointError)
    assert all(
        issubclass(getattr(e, n), e.EmbedpipeError)
        for n in dir(e)
        if n.endswith("Error") and n != "EmbedpipeError"
    )


def test_typed_package():
    from importlib.resources import files

    assert files("embedpipe").joinpath("py.typed").is_file()
