"""Data readers: a synthetic Criteo-like stream and a Criteo TSV reader, both yielding Batch."""

from readers.batch import Batch, DataExhaustedError, MalformedDataError
from readers.synthetic import SyntheticReader
from readers.tsv import TsvReader

__all__ = ["Batch", "DataExhaustedError", "MalformedDataError", "SyntheticReader", "TsvReader"]
