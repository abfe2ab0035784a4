from subnetdp.cli import program

if __name__ == "__main__":
    raise SystemExit(program())
