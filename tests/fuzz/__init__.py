"""A mutation fuzzer for every file kind the project reads (issue #19): ``python -m tests.fuzz``.

Each *target* (:mod:`tests.fuzz.targets`) has valid seed files from ``tests/fixtures`` (or built from
them), byte-level and structure-aware mutations (:mod:`tests.fuzz.mutate`: truncation, bit flips,
interesting integers, huge varint lengths, repeated and deeply nested protobuf fields, prototxt numbers
and nesting, LMDB pages and records, ``.npy`` headers) and the public readers it feeds them to.  Every
case runs in a forked child (:mod:`tests.fuzz.runner`) under a time limit and an address-space limit
(``RLIMIT_AS``), and ends as one of: ``ok`` (accepted), ``typed`` (a ``CaffeCompatError``), or a bug:
``untyped`` (any other exception), ``crash`` (killed by a signal), ``timeout`` or ``memory``
(``MemoryError`` or an allocator's failure).  The command prints a table per target and writes every
failing input, with a note of what happened, to ``--out``.
"""
