"""The parallelisms and their composition: the mesh (``mesh``), the order (``compose.parallelize``),
and one module or subpackage per dimension (``data_parallel``, ``tensor``, ``pipeline``,
``context``, ``experts``)."""
