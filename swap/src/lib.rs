//! tierzero-swap: async O_DIRECT swap I/O (design doc in progress).
