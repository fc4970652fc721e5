from rlhfless_sdk.cli.main import main

if __name__ == "__main__":
    main()
