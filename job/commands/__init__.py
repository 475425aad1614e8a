"""The commands that read runs (`python -m job runs`, `report`, `compare`): each a function a caller can use, and
its command line (`main`). They import no training code, so they start in well under a second."""
