"""Media of a request: fetching (data, file and guarded http URLs), decoding (simplejpeg, Pillow, PyAV), hashing,
the image and video plans, and writing pixels into shared memory segments."""
