"""The proxy extension (mkernel.verbs, cffi), imported on first use: importing mkernel needs no
built extension; using what needs it raises MKernelError saying how to build it."""


def proxy_ext():
    """(ffi, lib, have_verbs) of mkernel.verbs."""
    from mkernel import verbs  # lazy on purpose: an unbuilt extension raises here, not at `import mkernel`

    return verbs.ffi, verbs.lib, verbs.HAVE_VERBS
