"""Data readers: a synthetic Criteo-like stream and a Criteo TSV reader, both yielding Batch."""

from cnr.readers.batch import Batch, DataExhaustedError, MalformedDataError
from cnr.readers.synthetic import SyntheticReader
from cnr.readers.tsv import TsvReader

__all__ = ["Batch", "DataExhaustedError", "MalformedDataError", "SyntheticReader", "TsvReader"]
