module kvsnap.dev/kvsnap

go 1.19
