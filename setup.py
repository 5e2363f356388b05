"""The package's one compiled module; everything else about the build is in pyproject.toml.

service.wire._jsonrows reads a JSON body's integer rows natively (service/wire/jsonrows.py's fast path)
and writes an answer's big arrays (service/wire/jsonarrays.py), one abi3 build for every CPython from
3.11. It is optional: where it cannot be compiled (no C compiler or Python headers, as on a trainer
installing the client alone, which never reads it) the install goes on, and jsonrows.py reads the rows
(jsonarrays.py writes the arrays) with orjson instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "service.wire._jsonrows",
            sources=["service/wire/_jsonrows.c"],
            depends=["service/wire/_f32json.h"],
            py_limited_api=True,
            optional=True,
            extra_compile_args=["-O2"],
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
